"""Kernels of the small per-layer steps that both a decode token and a prefill chunk launch.

CUDA and Metal; the CPU runs their references (model/hyper_connection.py, model/compressor.py,
model/attention.py, model/quant_sim.py).
- `hc`: hyper-connections: a token's pre and update-plus-pre (`HCPre`, `HCPostPre`), a chunk's mix, split and
  update (`HCMix`, `HCSplit`, `HCUpdate`);
- `compressor`: a token's insert-pool-shift step (one or both compressors of a layer) and a chunk's pooling;
- `indexer`: the lightning indexer's scores and top k for a token's or a chunk's queries; on CUDA a chunk's scores
  may run on float16 tensor cores (`tensor_cores.halfsplit`);
- `rows`: finishing KV, compressed and indexer rows (norm, RoPE, FP8 / FP4 simulation) in one launch;
- `actquant`: the exact FP8 KV and Hadamard + FP4 round trips, whose arithmetic `rows` and `indexer` share.
"""
