"""GPU access: the NVML backend and its simulator, the Jetson backend (sysfs, nvpmodel) and its simulated boards,
the Tegra seam that composes the two on a JetPack 7 board, the CUDA probe and NVIDIA's tools.

Owns: every call into NVML (``nvml``: the only module that does), the Jetson's files (``jetson``), which source
serves which property on a Tegra board (``tegra``: the one module that imports both families), the simulated
hardware (``simnvml``, ``simjetson``, ``profiles``), the level-3 probe (``cudaprobe``) and the host tools (``tools``).
Must not import: control, KubeEdge, outbox, storage, status; the NVML and Jetson families do not import each other.
"""
