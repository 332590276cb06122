"""Floor 0: torch mechanisms shared by the capture, the Impls, the profiler and the runtime."""
