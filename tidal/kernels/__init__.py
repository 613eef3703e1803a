"""CPU kernels in C, compiled once per machine at first use; each has a torch fallback."""
