"""GPU access: the NVML backend and the simulated NVML."""
