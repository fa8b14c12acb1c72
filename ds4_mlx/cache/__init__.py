"""Sessions kept beyond the live one: checkpoints on disk between processes, and in memory.

- `kvstore`: the disk KV cache (`--kv-disk-dir`): checkpoints keyed by the text they cover, found again by prefix;
- `kvfiles`: its files: what may be opened in a shared directory, how a checkpoint is written, its checksum;
- `kvidentity`: which model a checkpoint belongs to (a footer every file carries), from `tensordigest`, a digest
  of every byte of the model file's tensor data, computed once per file and kept;
- `checkpoints`: in-memory snapshots (`--kv-ram-budget`) of the states agents come back to.
"""
