"""PyTorch reference implementation of the Clover block-diffusion MoE model (the oracle for all native code)."""
