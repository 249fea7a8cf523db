"""The tiled engine (see :mod:`.engine`), one module per job: :mod:`.fixed_point` (scales,
margins, trust checks), :mod:`.waves` (the general path: candidates in waves of tiles),
:mod:`.emulation` (the CUDA kernel's contract in PyTorch), :mod:`.device` (the
synchronisation-free GPU path and its CUDA graphs), :mod:`.ranking` (candidates to the
exact top-k)."""
