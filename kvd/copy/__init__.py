"""Page moves: coalesced runs, the GPU kernels, pinned staging."""
