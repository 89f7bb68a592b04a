"""maxsim_kernels: fused MaxSim kernels (Triton on CUDA, torch on CPU)."""
