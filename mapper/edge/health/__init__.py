"""GPU health as values: results and rules, no loop.

Owns: the health domain types (``checks``: check and probe results, the per-level report and its twin text, the
probe and tool Protocols), the XID catalog (``xid``) and the host-side driver checks over a root handed in
(``driverhost``). The loop that runs them is ``mapper.edge.control.healthloop``.
Must not import: any other ``mapper.edge`` package, or a third-party I/O library."""
