"""Where a step's model runs: this process (ModelRunner), or a tensor-parallel group of ranks."""
