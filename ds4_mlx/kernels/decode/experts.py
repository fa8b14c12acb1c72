"""The routed experts of a few tokens (decode) in two launches: gate and up with the SwiGLU epilogue, then down
summed over each token's slots.

For token t and slot i (expert e = ids[t, i], routing weight w[t, i]), `RoutedExperts._gathered` (model/moe.py)
computes

    h[t, i] = swiglu(x[t] @ W_gate[e].T, x[t] @ W_up[e].T, clamp) * w[t, i]     (GateUpSwiglu, one launch)
    out[t]  = sum_i h[t, i] @ W_down[e].T                                        (DownSum, one launch)

over raw IQ2_XXS / Q2_K / MXFP4 banks, where op by op it is three dequant-matvecs (matvec.py), a repeat, the SwiGLU's
elementwise ops and a sum. Both kernels read every selected weight once and are written for memory bandwidth:

- a threadgroup owns a few output rows of one token and keeps that token's activations in threadgroup memory
  (DownSum: one slot's at a time). They are stored unit by unit (a unit is the run of quants that shares its
  scales: 32 values for IQ2_XXS and MXFP4, 64 for Q2_K) and swizzled by 16-byte chunk, so that the lanes of a SIMD
  group, each reading chunk c of its own unit, hit different banks;
- its SIMD groups stage weight rows into threadgroup memory with 16-byte loads from all 32 lanes (smaller words
  where a row is not a multiple of 16 bytes): GateUpSwiglu the gate and up row of one (slot, output row) job,
  DownSum ROWS rows of the current slot's expert. The next job's (slot's) rows, and DownSum's next activations,
  are loaded into registers before the current ones are decoded, so that loads are in flight during the math;
- each lane decodes whole units of every staged row against the same activations in registers, and quants become
  floats without int-to-float conversions (a quarter of the FMA rate on NVIDIA GPUs): IQ2_XXS looks its grid codes
  and sign patterns up as 4-bit fields in threadgroup tables, turns eight of them into signed magnitudes (bytes
  biased by 128) with two byte permutes, and each byte into a float with one more (ds4_magic_byte); Q2_K masks
  four 2-bit quants at once and converts them the same way;
  MXFP4 looks its 4-bit codes up in a 16-entry threadgroup table of floats (its blocks start at odd offsets, so
  it reads codes a byte at a time);
- one SIMD reduction per row adds the lanes' partial sums (DownSum's run over all slots first); GateUpSwiglu's lane
  0 applies the clamped SwiGLU and the routing weight.

The references are the model's own formulas, handed in by model/moe.py: its weighted SwiGLU of two
`gathered_reference` products, and its sum over slots of a third one.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np
from gguf.quants import IQ2_XXS

from ...model.gguf import BLOCK_SIZES, GGMLType
from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from .fused_norm import PROBE_SCALE, Norm, apply, fits, normed_kernel, probe_norm, variant
from .iq2_xxs import grid_codes
from .mxfp4_matvec import E2M1_HEADER, E2M1_SETUP, half_scale
from .matvec import gathered_reference
from ..machinery.probe import random_activations, random_blocks
from ..machinery.registry import FastPath, current_backend

TOLERANCE = 1e-5
"""DownSum: float32 summation order only (units, lanes, then slots): ~1e-7 per add over a few thousand terms, with
margin (as matvec.py)."""
GATE_UP_TOLERANCE = 1e-4
"""GateUpSwiglu: the same reassociation in the two dot products (a few 1e-6 of their largest magnitude in either
result: the float32 reference is no closer to the exact value than the kernel), carried through the SwiGLU, whose
slope below the clamp is about clamp * weight while its largest output is about clamp^2 * weight: relative to that
largest output the error grows by max|gate| / clamp (~20 on the probe's random blocks: 1.1e-5 for the CUDA text
run on the CPU at Flash's shapes, against the CPU reference)."""
SHARED_BYTES = {"metal": 32 << 10}
"""Threadgroup memory a kernel may declare: Metal's whole budget; CUDA's static limit (DEFAULT_SHARED_BYTES)
elsewhere."""
DEFAULT_SHARED_BYTES = 48 << 10
GATE_UP_GROUPS = 512
DOWN_GROUPS = 256
"""Threadgroups wanted for one token: about 4 and 2 per SM of the H200 (132 SMs). Fewer rows per threadgroup
spread one token over more SMs; more rows load the activations into fewer threadgroups (16 KB each for gate/up,
8 KB per slot for down)."""
MAX_SIMDS = 8


@dataclass(frozen=True)
class Unit:
    """How the fused kernels read one quant type, a unit (`values` quants sharing their scales) at a time.

    `x_chunk` is the index of the float4 of an activation row that holds the unit's values 4 xc .. 4 xc + 3 for
    unit xu, in the order `decode` consumes them. `decode` adds unit u of the NQ staged rows (at mine + q *
    ROW_BYTES) to acc[q], reading the unit's activations as X4(u, c); `setup` declares and fills the threadgroup
    tables it reads (`table_bytes` of them; the kernel's first barrier follows).
    """

    ggml_type: GGMLType
    values: int
    x_chunk: str
    decode: str
    setup: str = ""
    header: str = ""
    table_bytes: int = 0


# --------------------------------------------------------------------------------------------------------------
# IQ2_XXS: 66-byte blocks of 256 values, d (f16) then eight 8-byte sub-blocks of 32 (iq2_xxs.py); a unit is one
# sub-block: four grid indices (u8) and a u32 whose 7-bit fields pick the sign pattern of each group of 8 and whose
# top 4 bits scale the sub-block.

MAGNITUDES = (8, 25, 43)
"""ggml's IQ2_XXS grid values, by the 2-bit code of iq2_xxs.grid_codes."""
BIAS = 128


def grid_nibbles() -> list[int]:
    """ggml's iq2xxs_grid as 32-bit words of 4-bit fields: value j's magnitude code (0, 1, 2) in bits 4j..4j+1."""
    return [sum(((code >> (2 * j)) & 3) << (4 * j) for j in range(8)) for code in grid_codes()]


def sign_nibbles() -> list[int]:
    """ggml's ksigns_iq2xs (seven stored sign bits and their parity) as 32-bit words: value j's sign at bit 4j + 2,
    so that grid_nibbles | sign_nibbles selects, per value, a byte of SIGNED_MAGNITUDES."""
    return [sum(((s >> j) & 1) << (4 * j + 2) for j in range(8)) for s in IQ2_XXS.ksigns]


def _bytes_word(values: list[int]) -> int:
    return sum(v << (8 * i) for i, v in enumerate(values))


SIGNED_MAGNITUDES = (_bytes_word([BIAS + m for m in MAGNITUDES]), _bytes_word([BIAS - m for m in MAGNITUDES]))
"""The byte-permute source words: bytes 0-2 hold BIAS + magnitude, bytes 4-6 BIAS - magnitude, by code."""


def _table(name: str, words: list[int]) -> str:
    return f"CONSTANT unsigned int {name}[{len(words)}] = {{" + ", ".join(f"{w}u" for w in words) + "};\n"


_IQ2_XXS_SETUP = """
SHARED unsigned int iq2_grid[256];
SHARED unsigned int iq2_signs[128];
for (int i = THREAD_IN_GROUP; i < 256; i += SIMDS * 32) {
  iq2_grid[i] = ds4_iq2xxs_grid_nibbles[i];
  if (i < 128) {
    iq2_signs[i] = ds4_iq2xxs_sign_nibbles[i];
  }
}
"""

_IQ2_XXS_DECODE = """
{
  const int sub = u & 7;
  unsigned int idx[NQ];
  unsigned int aux[NQ];
  float scale[NQ];
  float sum[NQ];
  for (int q = 0; q < NQ; ++q) {
    const SHARED_MEM unsigned short* b =
        reinterpret_cast<const SHARED_MEM unsigned short*>(mine + q * ROW_BYTES + (u >> 3) * 66);
    idx[q] = (unsigned int)b[1 + 4 * sub] | ((unsigned int)b[2 + 4 * sub] << 16);
    aux[q] = (unsigned int)b[3 + 4 * sub] | ((unsigned int)b[4 + 4 * sub] << 16);
    scale[q] = ds4_half_to_float(b[0]) * (0.5f + (float)(aux[q] >> 28)) * 0.25f;
    sum[q] = 0.0f;
  }
  for (int g = 0; g < 4; ++g) {
    const float4 xa = X4(u, 2 * g);
    const float4 xb = X4(u, 2 * g + 1);
    for (int q = 0; q < NQ; ++q) {
      const unsigned int sel = iq2_grid[(idx[q] >> (8 * g)) & 255u] | iq2_signs[(aux[q] >> (7 * g)) & 127u];
      const unsigned int lo = ds4_byte_perm(POSITIVEu, NEGATIVEu, sel);
      const unsigned int hi = ds4_byte_perm(POSITIVEu, NEGATIVEu, sel >> 16);
      float s = sum[q];
      s += (ds4_magic_byte(lo, 0) - OFFSETf) * xa.x;
      s += (ds4_magic_byte(lo, 1) - OFFSETf) * xa.y;
      s += (ds4_magic_byte(lo, 2) - OFFSETf) * xa.z;
      s += (ds4_magic_byte(lo, 3) - OFFSETf) * xa.w;
      s += (ds4_magic_byte(hi, 0) - OFFSETf) * xb.x;
      s += (ds4_magic_byte(hi, 1) - OFFSETf) * xb.y;
      s += (ds4_magic_byte(hi, 2) - OFFSETf) * xb.z;
      s += (ds4_magic_byte(hi, 3) - OFFSETf) * xb.w;
      sum[q] = s;
    }
  }
  for (int q = 0; q < NQ; ++q) {
    acc[q] += scale[q] * sum[q];
  }
}
""".replace("POSITIVE", str(SIGNED_MAGNITUDES[0])).replace("NEGATIVE", str(SIGNED_MAGNITUDES[1])).replace(
    "OFFSET", f"{float((1 << 23) + BIAS)!r}")

IQ2_XXS_UNIT = Unit(
    GGMLType.IQ2_XXS, values=32, x_chunk="xu * 8 + xc", decode=_IQ2_XXS_DECODE, setup=_IQ2_XXS_SETUP,
    header=_table("ds4_iq2xxs_grid_nibbles", grid_nibbles()) + _table("ds4_iq2xxs_sign_nibbles", sign_nibbles()),
    table_bytes=4 * (256 + 128),
)

# --------------------------------------------------------------------------------------------------------------
# Q2_K: 84-byte blocks of 256 values, scales[16], qs[64], d, dmin (q2_k.py). A unit is the 16 qs bytes
# qs[32h + 16t ..] (u = 4 block + 2h + t) and their 64 values: four runs j of 16, value 128h + 32j + 16t + l with
# quant (qs[32h + 16t + l] >> 2j) & 3 and scale byte 8h + 2j + t. Per run: d * scale * sum(q x) - dmin * min * sum(x).

_Q2_K_DECODE = """
{
  const int hh = (u >> 1) & 1;
  const int t = u & 1;
  unsigned int qw[4 * NQ];
  unsigned int scw[2 * NQ];
  float d[NQ];
  float dmin[NQ];
  float part[NQ];
  for (int q = 0; q < NQ; ++q) {
    const SHARED_MEM unsigned int* b =
        reinterpret_cast<const SHARED_MEM unsigned int*>(mine + q * ROW_BYTES + (u >> 2) * 84);
    for (int i = 0; i < 4; ++i) {
      qw[4 * q + i] = b[4 + 8 * hh + 4 * t + i];
    }
    scw[2 * q] = b[2 * hh];
    scw[2 * q + 1] = b[2 * hh + 1];
    const unsigned int dd = b[20];
    d[q] = ds4_half_to_float((unsigned short)(dd & 65535u));
    dmin[q] = ds4_half_to_float((unsigned short)(dd >> 16));
    part[q] = 0.0f;
  }
  for (int j = 0; j < 4; ++j) {
    float4 xq[4];
    float xsum = 0.0f;
    for (int i = 0; i < 4; ++i) {
      xq[i] = X4(u, 4 * j + i);
      xsum += (xq[i].x + xq[i].y) + (xq[i].z + xq[i].w);
    }
    for (int q = 0; q < NQ; ++q) {
      const unsigned int sc = (scw[2 * q + (j >> 1)] >> (8 * (2 * (j & 1) + t))) & 255u;
      float dot = 0.0f;
      for (int i = 0; i < 4; ++i) {
        const unsigned int quants = (qw[4 * q + i] >> (2 * j)) & 0x03030303u;
        dot += (ds4_magic_byte(quants, 0) - 8388608.0f) * xq[i].x;
        dot += (ds4_magic_byte(quants, 1) - 8388608.0f) * xq[i].y;
        dot += (ds4_magic_byte(quants, 2) - 8388608.0f) * xq[i].z;
        dot += (ds4_magic_byte(quants, 3) - 8388608.0f) * xq[i].w;
      }
      part[q] += d[q] * (float)(sc & 15u) * dot - dmin[q] * (float)(sc >> 4) * xsum;
    }
  }
  for (int q = 0; q < NQ; ++q) {
    acc[q] += part[q];
  }
}
"""

Q2_K_UNIT = Unit(GGMLType.Q2_K, values=64,
                 x_chunk="(xu >> 2) * 64 + ((xu >> 1) & 1) * 32 + (xu & 1) * 4 + (xc >> 2) * 8 + (xc & 3)",
                 decode=_Q2_K_DECODE)

# --------------------------------------------------------------------------------------------------------------
# MXFP4: 17-byte blocks of 32 values, an E8M0 scale byte then 16 code bytes (mxfp4_matvec.py); a unit is one block:
# value j (chunk j / 4) is the low nibble of code byte j, value j + 16 (chunk 4 + j / 4) its high nibble. Codes are
# looked up in the threadgroup table of doubled E2M1 values, the block's dot product scaled once by d / 2.

_MXFP4_DECODE = """
{
  float dot[NQ];
  for (int q = 0; q < NQ; ++q) {
    dot[q] = 0.0f;
  }
  for (int i = 0; i < 4; ++i) {
    const float4 xl = X4(u, i);
    const float4 xh = X4(u, i + 4);
    for (int q = 0; q < NQ; ++q) {
      const SHARED_MEM unsigned char* qs = mine + q * ROW_BYTES + u * 17 + 1 + 4 * i;
      float s = dot[q];
      s += e2m1x2[qs[0] & 15u] * xl.x + e2m1x2[qs[0] >> 4] * xh.x;
      s += e2m1x2[qs[1] & 15u] * xl.y + e2m1x2[qs[1] >> 4] * xh.y;
      s += e2m1x2[qs[2] & 15u] * xl.z + e2m1x2[qs[2] >> 4] * xh.z;
      s += e2m1x2[qs[3] & 15u] * xl.w + e2m1x2[qs[3] >> 4] * xh.w;
      dot[q] = s;
    }
  }
  for (int q = 0; q < NQ; ++q) {
    const unsigned int scale_byte = mine[q * ROW_BYTES + u * 17];
    acc[q] += HALF_SCALE * dot[q];
  }
}
""".replace("HALF_SCALE", half_scale("scale_byte"))

MXFP4_UNIT = Unit(GGMLType.MXFP4, values=32, x_chunk="xu * 8 + xc", decode=_MXFP4_DECODE, setup=E2M1_SETUP,
                  header=E2M1_HEADER, table_bytes=4 * 16)

UNITS = {unit.ggml_type: unit for unit in (IQ2_XXS_UNIT, Q2_K_UNIT, MXFP4_UNIT)}

# --------------------------------------------------------------------------------------------------------------
# The two kernels. Template constants: IN, OUT, ROW_BYTES, ROW_WORDS (a row in WORDs, the staging load), UNITS (a
# row's units), CHUNKS (float4s per unit, a power of two), K (slots per token), SIMDS; GateUpSwiglu RB (output rows
# per threadgroup) and CLAMP_BITS, DownSum ROWS (rows per SIMD group).

_X4 = "#define X4(u, c) xsh[(u) * CHUNKS + (((c) + (u)) & (CHUNKS - 1))]\n"

_GATE_UP = _X4 + """
const int token = GROUP_Y;
const int lane = SIMD_LANE;
const int NQ = 2;
const int JOBS = K * RB;
const int COPY_STEPS = (ROW_WORDS + 31) / 32;
const float CLAMP = ds4_float((unsigned int)CLAMP_BITS);
SHARED float4 xsh[IN / 4];
SHARED STAGE_WORD stage[SIMDS * 2 * ROW_WORDS];
@SHARED float squares_part[SIMDS];
/*SETUP*/
const GLOBAL_MEM float4* xg = reinterpret_cast<const GLOBAL_MEM float4*>(x) + (size_t)token * (IN / 4);
@float squares = 0.0f;
for (int i = THREAD_IN_GROUP; i < IN / 4; i += SIMDS * 32) {
  const int xu = i / CHUNKS;
  const int xc = i % CHUNKS;
  X4(xu, xc) = xg[/*X_CHUNK*/];
@  const float4 v = X4(xu, xc);
@  squares += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
}
@// the input norm: the group's sum of squares, then each thread scales the chunks it staged by 1 / rms and norm_w
@squares = ds4_simd_sum(squares);
@if (lane == 0) {
@  squares_part[SIMD_INDEX] = squares;
@}
@ds4_barrier();
@float sum_squares = 0.0f;
@for (int s = 0; s < SIMDS; ++s) {
@  sum_squares += squares_part[s];
@}
@const float inv_rms = 1.0f / sqrt(sum_squares / (float)IN + NORM_EPS);
@const GLOBAL_MEM float4* nv = reinterpret_cast<const GLOBAL_MEM float4*>(norm_w);
@for (int i = THREAD_IN_GROUP; i < IN / 4; i += SIMDS * 32) {
@  const int xu = i / CHUNKS;
@  const int xc = i % CHUNKS;
@  const float4 nw = nv[/*X_CHUNK*/];
@  float4 v = X4(xu, xc);
@  v.x = v.x * inv_rms * nw.x;
@  v.y = v.y * inv_rms * nw.y;
@  v.z = v.z * inv_rms * nw.z;
@  v.w = v.w * inv_rms * nw.w;
@  X4(xu, xc) = v;
@}
ds4_barrier();

SHARED_MEM STAGE_WORD* mine_words = stage + SIMD_INDEX * (2 * ROW_WORDS);
const SHARED_MEM unsigned char* mine = reinterpret_cast<const SHARED_MEM unsigned char*>(mine_words);
const GLOBAL_MEM STAGE_WORD* gate_words = reinterpret_cast<const GLOBAL_MEM STAGE_WORD*>(gate);
const GLOBAL_MEM STAGE_WORD* up_words = reinterpret_cast<const GLOBAL_MEM STAGE_WORD*>(up);
STAGE_WORD gate_next[COPY_STEPS];
STAGE_WORD up_next[COPY_STEPS];
// job = (slot job % K, row RB * GROUP_X + job / K); each iteration stages one job and loads the next
for (int job = SIMD_INDEX - SIMDS; job < JOBS; job += SIMDS) {
  if (job >= 0) {
    for (int s = 0; s < COPY_STEPS; ++s) {
      const int i = lane + 32 * s;
      if (i < ROW_WORDS) {
        mine_words[i] = gate_next[s];
        mine_words[ROW_WORDS + i] = up_next[s];
      }
    }
    ds4_simd_barrier();
  }
  const int next = job + SIMDS;
  if (next < JOBS) {
    const size_t first = ((size_t)ids[token * K + next % K] * OUT + RB * GROUP_X + next / K) * ROW_WORDS;
    for (int s = 0; s < COPY_STEPS; ++s) {
      const int i = lane + 32 * s;
      if (i < ROW_WORDS) {
        gate_next[s] = gate_words[first + i];
        up_next[s] = up_words[first + i];
      }
    }
  }
  if (job >= 0) {
    float acc[NQ];
    for (int q = 0; q < NQ; ++q) {
      acc[q] = 0.0f;
    }
    for (int u = lane; u < UNITS; u += 32) {
/*DECODE*/
    }
    const float g = ds4_simd_sum(acc[0]);
    const float v = ds4_simd_sum(acc[1]);
    if (lane == 0) {
      const int pair = token * K + job % K;
      const float gc = g > CLAMP ? CLAMP : g;
      const float vc = v > CLAMP ? CLAMP : (v < -CLAMP ? -CLAMP : v);
      h[(size_t)pair * OUT + RB * GROUP_X + job / K] = gc * ds4_div(1.0f, 1.0f + ds4_exp(-gc)) * vc * weights[pair];
    }
    ds4_simd_barrier();
  }
}
"""

_DOWN_SUM = _X4 + """
const int token = GROUP_Y;
const int lane = SIMD_LANE;
const int NQ = ROWS;
const int X_STEPS = (IN / 4 + SIMDS * 32 - 1) / (SIMDS * 32);
const int COPY_STEPS = (ROWS * ROW_WORDS + 31) / 32;
SHARED float4 xsh[IN / 4];
SHARED STAGE_WORD stage[SIMDS * ROWS * ROW_WORDS];
/*SETUP*/
SHARED_MEM STAGE_WORD* mine_words = stage + SIMD_INDEX * (ROWS * ROW_WORDS);
const SHARED_MEM unsigned char* mine = reinterpret_cast<const SHARED_MEM unsigned char*>(mine_words);
const int row0 = (GROUP_X * SIMDS + SIMD_INDEX) * ROWS;
const GLOBAL_MEM float4* xg = reinterpret_cast<const GLOBAL_MEM float4*>(x) + (size_t)token * K * (IN / 4);
const GLOBAL_MEM STAGE_WORD* w_words = reinterpret_cast<const GLOBAL_MEM STAGE_WORD*>(w);
float4 x_next[X_STEPS];
STAGE_WORD w_next[COPY_STEPS];
float acc[NQ];
for (int q = 0; q < NQ; ++q) {
  acc[q] = 0.0f;
}
// each iteration stages one slot (activations shared by all SIMD groups, rows per SIMD group), loads the next
for (int slot = -1; slot < K; ++slot) {
  if (slot >= 0) {
    ds4_barrier();
    for (int s = 0; s < X_STEPS; ++s) {
      const int i = THREAD_IN_GROUP + SIMDS * 32 * s;
      if (i < IN / 4) {
        X4(i / CHUNKS, i % CHUNKS) = x_next[s];
      }
    }
    for (int s = 0; s < COPY_STEPS; ++s) {
      const int i = lane + 32 * s;
      if (i < ROWS * ROW_WORDS) {
        mine_words[i] = w_next[s];
      }
    }
    ds4_barrier();
  }
  if (slot + 1 < K) {
    const GLOBAL_MEM float4* xs = xg + (size_t)(slot + 1) * (IN / 4);
    for (int s = 0; s < X_STEPS; ++s) {
      const int i = THREAD_IN_GROUP + SIMDS * 32 * s;
      if (i < IN / 4) {
        const int xu = i / CHUNKS;
        const int xc = i % CHUNKS;
        x_next[s] = xs[/*X_CHUNK*/];
      }
    }
    const GLOBAL_MEM STAGE_WORD* src = w_words + ((size_t)ids[token * K + slot + 1] * OUT + row0) * ROW_WORDS;
    for (int s = 0; s < COPY_STEPS; ++s) {
      const int i = lane + 32 * s;
      if (i < ROWS * ROW_WORDS) {
        w_next[s] = src[i];
      }
    }
  }
  if (slot >= 0) {
    for (int u = lane; u < UNITS; u += 32) {
/*DECODE*/
    }
  }
}
for (int r = 0; r < ROWS; ++r) {
  const float total = ds4_simd_sum(acc[r]);
  if (lane == 0) {
    y[(size_t)token * OUT + row0 + r] = total;
  }
}
"""

WORDS = {16: "uint4", 4: "unsigned int", 2: "unsigned short"}


def copy_word(row_bytes: int) -> int | None:
    """The widest load (16, 4 or 2 bytes) that tiles a row (rows start at multiples of row_bytes); None for a row
    of an odd number of bytes (MXFP4's 17-byte blocks, an odd number of them), which the kernels do not take."""
    return next((size for size in WORDS if row_bytes % size == 0), None)


def _render(skeleton: str, unit: Unit, word: int) -> str:
    return (skeleton.replace("/*SETUP*/", unit.setup).replace("/*X_CHUNK*/", unit.x_chunk)
            .replace("/*DECODE*/", unit.decode).replace("STAGE_WORD", WORDS[word]))


@cache
def gate_up_kernel(ggml_type: GGMLType, word: int, eps: float | None = None) -> Kernel:
    """GateUpSwiglu's kernel for one quant type and staging word size; with an epsilon, the variant that norms x
    (its `@` lines, fused_norm.py; without, the text is exactly the plain kernel's)."""
    unit = UNITS[ggml_type]
    names = (f"ds4_gate_up_swiglu_{ggml_type.name.lower()}_w{word}", ("x", "gate", "up", "ids", "weights"), ("h",))
    source = _render(_GATE_UP, unit, word)
    if eps is None:
        return Kernel(*names, variant(source, False), unit.header)
    return normed_kernel(*names, source, eps, unit.header)


@cache
def down_sum_kernel(ggml_type: GGMLType, word: int) -> Kernel:
    """DownSum's kernel for one quant type and staging word size."""
    unit = UNITS[ggml_type]
    return Kernel(f"ds4_down_sum_{ggml_type.name.lower()}_w{word}", ("x", "w", "ids"), ("y",),
                  _render(_DOWN_SUM, unit, word), unit.header)


# --------------------------------------------------------------------------------------------------------------
# Launch plans


def row_bytes(ggml_type: GGMLType, n_in: int) -> int:
    """Bytes of one stored row of n_in values."""
    block_values, block_bytes = BLOCK_SIZES[ggml_type]
    return n_in // block_values * block_bytes


def rows_per_group(n_out: int, groups: int) -> int:
    """The most rows per threadgroup, a power of two dividing n_out, that still makes `groups` threadgroups (or 1)."""
    rows = 1
    while n_out % (2 * rows) == 0 and n_out // (2 * rows) >= groups:
        rows *= 2
    return rows


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


@dataclass(frozen=True)
class Plan:
    """One launch: SIMD groups per threadgroup, rows per threadgroup, and the threadgroup memory they declare."""

    simds: int
    rows: int
    shared_bytes: int


def gate_up_plan(ggml_type: GGMLType, n_out: int, n_in: int, k: int, budget: int, norm: bool = False) -> Plan | None:
    """RB rows x k slots per threadgroup, one (slot, row) job per SIMD group at a time; None if it cannot fit. The
    normed kernel also declares one float per SIMD group (its partial sums of squares)."""
    unit, size = UNITS[ggml_type], row_bytes(ggml_type, n_in)
    fixed = 4 * n_in + unit.table_bytes + (4 * MAX_SIMDS if norm else 0)
    rows = rows_per_group(n_out, GATE_UP_GROUPS)
    simds = min(MAX_SIMDS, _floor_pow2(k * rows), _floor_pow2(max(0, budget - fixed) // (2 * size)))
    return Plan(simds, rows, fixed + simds * 2 * size) if simds else None


def down_plan(ggml_type: GGMLType, n_out: int, n_in: int, budget: int) -> Plan | None:
    """SIMDS groups of ROWS rows per threadgroup (`Plan.rows` is SIMDS x ROWS); None if it cannot fit."""
    unit, size = UNITS[ggml_type], row_bytes(ggml_type, n_in)
    fixed = 4 * n_in + unit.table_bytes
    rows = rows_per_group(n_out, DOWN_GROUPS)
    while rows and fixed + rows * size > budget:
        rows //= 2
    return Plan(min(MAX_SIMDS, rows), rows, fixed + rows * size) if rows else None


def shared_budget() -> int:
    """Threadgroup memory the kernels may declare on the current backend."""
    return SHARED_BYTES.get(current_backend(), DEFAULT_SHARED_BYTES)


def _probe_ids(k: int) -> mx.array:
    """Two tokens over three experts: token 0 cycles through them (distinct and repeated ids for k > 3), token 1
    puts expert 2 first and repeats expert 1."""
    return mx.array([[i % 3 for i in range(k)], [2] + [1] * (k - 1)], dtype=mx.int32)


PROBE_EXPERTS = 3


class GateUpSwiglu:
    """h (T*k, OUT) for x (T, IN), ids and weights (T, k) over raw gate and up banks (E, OUT, IN) of one type, by one
    kernel where it passed its check. `activation(gate, up, weights, clamp)` is the model's weighted SwiGLU.

    With `norm` (weight (IN,) float32, eps) x is first rms_norm(x, weight, eps): the kernel's threadgroups each
    stage all of their token's x anyway, so they sum its squares as they stage it and scale it in threadgroup
    memory before the products (one more barrier), which takes the norm's own launch out of a decode step. Key:
    the plain kernel's, and the epsilon after it."""

    def __init__(self, activation: Callable[[mx.array, mx.array, mx.array, float], mx.array]):
        self.activation = activation
        self.fast_path = FastPath("gate_up_swiglu", self._reference, self._kernel, self._probe,
                                  tolerance=GATE_UP_TOLERANCE, backends=("cuda", "metal"))

    def enabled(self, ggml_type: int, shape: tuple[int, int, int], k: int, clamp: float,
                norm: Norm | None = None) -> bool:
        """Whether __call__ takes the kernel for these banks (checking it first if this is its first use)."""
        if (ggml_type not in UNITS or not fits(norm, shape[2])
                or copy_word(row_bytes(GGMLType(ggml_type), shape[2])) is None
                or gate_up_plan(GGMLType(ggml_type), *shape[1:], k, shared_budget(), norm is not None) is None):
            return False
        return self.fast_path.enabled(self._key(ggml_type, shape, k, clamp, norm))

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array, gate: mx.array, up: mx.array,
                 ggml_type: int, shape: tuple[int, int, int], clamp: float, norm: Norm | None = None) -> mx.array:
        return self.fast_path(x, ids, weights, gate, up, ggml_type, shape, clamp, norm,
                              key=self._key(ggml_type, shape, ids.shape[1], clamp, norm))

    @staticmethod
    def _key(ggml_type: int, shape: tuple[int, int, int], k: int, clamp: float, norm: Norm | None) -> Hashable:
        return (GGMLType(ggml_type), shape[1], shape[2], k, clamp) + (() if norm is None else (float(norm[1]),))

    def _reference(self, x, ids, weights, gate, up, ggml_type, shape, clamp, norm=None) -> mx.array:
        flat = ids.reshape(-1)
        xs = mx.repeat(apply(x, norm), ids.shape[1], axis=0)
        return self.activation(gathered_reference(xs, gate, flat, ggml_type, shape),
                               gathered_reference(xs, up, flat, ggml_type, shape), weights, clamp)

    def _kernel(self, x, ids, weights, gate, up, ggml_type, shape, clamp, norm=None) -> mx.array:
        ggml_type = GGMLType(ggml_type)
        t, k = ids.shape
        _, n_out, n_in = shape
        plan = gate_up_plan(ggml_type, n_out, n_in, k, shared_budget(), norm is not None)
        if plan is None:
            raise ValueError(f"{n_in} activations and two rows per SIMD group do not fit threadgroup memory")
        word, template = _row_template(ggml_type, n_out, n_in, k, plan.simds)
        eps, extra = (None, []) if norm is None else (float(norm[1]), [norm[0]])
        (h,) = build(gate_up_kernel(ggml_type, word, eps), current_backend())(
            inputs=[x.astype(mx.float32), gate, up, ids.astype(mx.int32), weights.astype(mx.float32), *extra],
            template=template + [("RB", plan.rows), ("CLAMP_BITS", struct.unpack("<i", struct.pack("<f", clamp))[0])],
            grid=(n_out // plan.rows * plan.simds * SIMD_WIDTH, t, 1),
            threadgroup=(plan.simds * SIMD_WIDTH, 1, 1),
            output_shapes=[(t * k, n_out)],
            output_dtypes=[mx.float32],
        )
        return h

    def _probe(self, key: Hashable) -> tuple:
        """A key ending in an epsilon is the normed kernel's: activations off unit rms (by a different factor per
        token, so that each token's own 1 / rms matters), a norm weight around 1."""
        ggml_type, n_out, n_in, k, clamp, *eps = key
        shape = (PROBE_EXPERTS, n_out, n_in)
        gate, up = (random_blocks(ggml_type, PROBE_EXPERTS * n_out, n_in, seed=seed).reshape(PROBE_EXPERTS, -1)
                    for seed in (31, 32))
        ids = _probe_ids(k)
        weights = mx.array(np.random.default_rng(33).uniform(0.1, 1.5, ids.shape).astype(np.float32))
        x = random_activations((2, n_in), seed=34)
        if not eps:
            return x, ids, weights, gate, up, ggml_type, shape, clamp, None
        norm = probe_norm(n_in, eps[0], seed=37)
        return x * mx.array([[PROBE_SCALE], [1.0 / PROBE_SCALE]]), ids, weights, gate, up, ggml_type, shape, clamp, norm


def _row_template(ggml_type: GGMLType, n_out: int, n_in: int, k: int, simds: int) -> tuple[int, list[tuple[str, int]]]:
    """The copy word of a bank row and the row-layout constants both expert kernels take."""
    size = row_bytes(ggml_type, n_in)
    word = copy_word(size)
    values = UNITS[ggml_type].values
    return word, [("IN", n_in), ("OUT", n_out), ("ROW_BYTES", size), ("ROW_WORDS", size // word),
                  ("UNITS", n_in // values), ("CHUNKS", values // 4), ("K", k), ("SIMDS", simds)]


class DownSum:
    """out (T, OUT) = sum over slots of h[t, i] @ W[ids[t, i]].T for h (T*k, IN), ids (T, k) and a raw bank (E, OUT,
    IN), by one kernel where it passed its check. `slot_sum(y, k)` is the model's sum of (T*k, OUT) over slots."""

    def __init__(self, slot_sum: Callable[[mx.array, int], mx.array]):
        self.slot_sum = slot_sum
        self.fast_path = FastPath("down_sum", self._reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def enabled(self, ggml_type: int, shape: tuple[int, int, int], k: int) -> bool:
        """Whether __call__ takes the kernel for this bank (checking it first if this is its first use)."""
        if (ggml_type not in UNITS or copy_word(row_bytes(GGMLType(ggml_type), shape[2])) is None
                or down_plan(GGMLType(ggml_type), *shape[1:], shared_budget()) is None):
            return False
        return self.fast_path.enabled((GGMLType(ggml_type), shape[1], shape[2], k))

    def __call__(self, h: mx.array, ids: mx.array, blocks: mx.array, ggml_type: int,
                 shape: tuple[int, int, int]) -> mx.array:
        return self.fast_path(h, ids, blocks, ggml_type, shape,
                              key=(GGMLType(ggml_type), shape[1], shape[2], ids.shape[1]))

    def _reference(self, h, ids, blocks, ggml_type, shape) -> mx.array:
        return self.slot_sum(gathered_reference(h, blocks, ids.reshape(-1), ggml_type, shape), ids.shape[1])

    def _kernel(self, h, ids, blocks, ggml_type, shape) -> mx.array:
        ggml_type = GGMLType(ggml_type)
        t, k = ids.shape
        _, n_out, n_in = shape
        plan = down_plan(ggml_type, n_out, n_in, shared_budget())
        if plan is None:
            raise ValueError(f"{n_in} activations and one row per SIMD group do not fit threadgroup memory")
        word, template = _row_template(ggml_type, n_out, n_in, k, plan.simds)
        (y,) = build(down_sum_kernel(ggml_type, word), current_backend())(
            inputs=[h.astype(mx.float32), blocks, ids.astype(mx.int32)],
            template=template + [("ROWS", plan.rows // plan.simds)],
            grid=(n_out // plan.rows * plan.simds * SIMD_WIDTH, t, 1),
            threadgroup=(plan.simds * SIMD_WIDTH, 1, 1),
            output_shapes=[(t, n_out)],
            output_dtypes=[mx.float32],
        )
        return y

    def _probe(self, key: Hashable) -> tuple:
        ggml_type, n_out, n_in, k = key
        shape = (PROBE_EXPERTS, n_out, n_in)
        blocks = random_blocks(ggml_type, PROBE_EXPERTS * n_out, n_in, seed=35).reshape(PROBE_EXPERTS, -1)
        ids = _probe_ids(k)
        return random_activations((ids.size, n_in), seed=36), ids, blocks, ggml_type, shape
