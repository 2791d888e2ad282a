"""The operator's one-shot commands: ``gpu-mapper buffer`` (``buffer``: stats, export, compact, vacuum of a
buffer file, with sqlite-utils) and ``gpu-mapper discover`` / ``model`` (``discover``: Device and DeviceModel YAML).

Must not import: ``mapper.cli``; never imported by the running mapper or the bridge."""
