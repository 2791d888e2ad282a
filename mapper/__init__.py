"""gpu-mapper: a KubeEdge device mapper that makes every GPU of an edge node a KubeEdge Device."""

__version__ = "0.1.0"
