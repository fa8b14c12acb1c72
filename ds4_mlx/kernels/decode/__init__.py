"""The decode step's kernels: a few token rows against every weight read once, written for memory bandwidth.

CUDA and Metal (one text each, `machinery.dialect`); the CPU runs their references.
- `matvec`: dequant-matvec over raw blocks, with its per-type units `iq2_xxs` and `q2_k` (q2 files' experts);
- `affine_matvec`: a few rows times an affine Q8_0 / Q4_K matrix (or selected experts), SwiGLU folded in for down;
- `half`: F16 matrices kept as float16 times a few rows; `fused_norm`: an input RMSNorm folded into these matvecs;
- `experts`: a token's routed experts over raw IQ2_XXS / Q2_K banks in two launches;
- `router`: the learned router's selection (and on CUDA the gate's matvec with it, `GatedRoute`) and hash routes;
- `attention`: RoPE and one query token's attention over its window and compressed or picked rows;
- `ends`: the token's embedding as the streams, and the final hyper-connection collapse.

The step's other kernels have a chunk form as well and live in `sublayers`.
"""
