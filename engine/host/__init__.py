"""What the engine needs from the machine: private directories and atomic files, memory, and fast BLAS."""
