// The int8/int4 linear with int8 activations: its tiles and their loop, written once over two byte-dot primitives and
// compiled once per instruction set. linear_int_a8.cpp includes this file in namespace avx2 and in namespace vnni,
// each after defining TIDAL_TARGET and
//   __m256i dot(acc, u, s): acc + the sums of each 4 consecutive products u[j] * s[j] (u unsigned, s signed bytes),
//   __m256i dot2(acc, u, s, v, t): dot(dot(acc, u, s), v, t),
//   kRowsCols: the column blocks a tile of several rows covers (as many as the registers hold),
//   kUnsignedInt8: int8 weights go in as q + 128 (dot must not saturate) rather than as |q| with x's sign flipped,
// so both paths run the same algorithm and give the same integers.
//
// No include guard: it is meant to be included once per namespace.

TIDAL_TARGET inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [row, row + R) by column blocks [block, block + C). Per block of 32 inputs the int32 sums are scaled
// into the float sums by scale_g * sx_b; per group the offsets take sum_g(x') off.
template <int R, int C, int BITS>
TIDAL_TARGET __attribute__((noinline)) void tile(const Problem& p, int64_t row, int64_t block, Ahead ahead = {}) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // q + 128 as an unsigned byte: q xor 0x80
  const int64_t line = block_bytes(p.k, BITS);
  const int64_t xblocks = p.k / kXBlock, per_group = p.group_size / kXBlock;
  const uint8_t* w = p.w + block * line;
  __m256 y[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[c][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256 scale[C];
    for (int c = 0; c < C; ++c) scale[c] = _mm256_loadu_ps(p.scales + ((block + c) * p.groups + g) * kCols);
    for (int64_t b = g * per_group; b < std::min(xblocks, (g + 1) * per_group); ++b) {
      for (int64_t at = b * ahead.per_block; at < std::min(ahead.bytes, (b + 1) * ahead.per_block); at += 64)
        _mm_prefetch(ahead.base + at, _MM_HINT_T1);
      __m256i acc[C][R];
      for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_si256();
      if constexpr (BITS == 8) {
        _Pragma("GCC unroll 8") for (int s = 0; s < 8; ++s) {
          const int64_t i = b * kXBlock + 4 * s;
          __m256i xv[R];
          for (int r = 0; r < R; ++r) xv[r] = broadcast4(p.qx + (row + r) * p.k + i);
          for (int c = 0; c < C; ++c) {
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * line + i * kCols));
            if constexpr (kUnsignedInt8) {
              const __m256i shifted = _mm256_xor_si256(wv, flip);
              for (int r = 0; r < R; ++r) acc[c][r] = dot(acc[c][r], shifted, xv[r]);
            } else {
              const __m256i magnitude = _mm256_sign_epi8(wv, wv);
              for (int r = 0; r < R; ++r) acc[c][r] = dot(acc[c][r], magnitude, _mm256_sign_epi8(xv[r], wv));
            }
          }
        }
        if constexpr (kUnsignedInt8) {  // sum (q + 128) x - 128 sum x = sum q x, exactly, as the other path's
          for (int r = 0; r < R; ++r) {
            const __m256i excess = _mm256_set1_epi32(128 * p.qsum[(row + r) * xblocks + b]);
            for (int c = 0; c < C; ++c) acc[c][r] = _mm256_sub_epi32(acc[c][r], excess);
          }
        }
      } else {
        _Pragma("GCC unroll 4") for (int s = 0; s < 4; ++s) {
          const int64_t i = b * kXBlock + 8 * s;
          __m256i low_x[R], high_x[R];
          for (int r = 0; r < R; ++r) {
            low_x[r] = broadcast4(p.qx + (row + r) * p.k + i);
            high_x[r] = broadcast4(p.qx + (row + r) * p.k + i + 4);
          }
          for (int c = 0; c < C; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * line + i * kCols / 2));
            const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            for (int r = 0; r < R; ++r) acc[c][r] = dot2(acc[c][r], low, low_x[r], high, high_x[r]);
          }
        }
        if (p.offsets == nullptr) {  // symmetric int4: u = q + 8, so sum q x = sum u x - 8 sum x, exactly
          for (int r = 0; r < R; ++r) {
            const __m256i excess = _mm256_set1_epi32(8 * p.qsum[(row + r) * xblocks + b]);
            for (int c = 0; c < C; ++c) acc[c][r] = _mm256_sub_epi32(acc[c][r], excess);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 sx = _mm256_set1_ps(p.sx[(row + r) * xblocks + b]);
        for (int c = 0; c < C; ++c)
          y[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[c][r]), _mm256_mul_ps(scale[c], sx), y[c][r]);
      }
    }
    if (p.offsets != nullptr) {
      for (int c = 0; c < C; ++c) {
        const __m256 offset = _mm256_loadu_ps(p.offsets + ((block + c) * p.groups + g) * kCols);
        for (int r = 0; r < R; ++r)
          y[c][r] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(p.sumx[(row + r) * p.groups + g]), y[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t col = (block + c) * kCols, valid = std::min<int64_t>(kCols, p.n - col);
    if (valid == kCols) {  // a whole block: one vector store per row, not a copy through the stack
      const __m256 bias = p.bias != nullptr ? _mm256_loadu_ps(p.bias + col) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        if (p.out_bf16 != nullptr) store8_bf16(p.out_bf16 + (row + r) * p.n + col, _mm256_add_ps(y[c][r], bias));
        else _mm256_storeu_ps(p.out + (row + r) * p.n + col, _mm256_add_ps(y[c][r], bias));
      }
      continue;
    }
    alignas(32) float bias[kCols] = {};
    if (p.bias != nullptr) std::copy(p.bias + col, p.bias + col + valid, bias);
    for (int r = 0; r < R; ++r) {
      alignas(32) float result[kCols];
      _mm256_store_ps(result, _mm256_add_ps(y[c][r], _mm256_load_ps(bias)));
      if (p.out_bf16 != nullptr) std::copy(result, result + valid, p.out_bf16 + (row + r) * p.n + col);
      else std::copy(result, result + valid, p.out + (row + r) * p.n + col);
    }
  }
}

// Every row by column blocks [block, block + C): four rows at a time, then the rest. Each four-row tile prefetches
// its share of `ahead` (the next blocks' weights), so the whole of it arrives while these blocks are computed.
template <int C, int BITS>
TIDAL_TARGET void rows_by_blocks(const Problem& p, int64_t block, Ahead ahead = {}) {
  const int64_t tiles = (p.m + 3) / 4, xblocks = p.k / kXBlock;
  const int64_t share = (ahead.bytes / tiles + 63) / 64 * 64;
  int64_t row = 0;
  auto part = [&](int64_t t) {  // tile t's slice of ahead
    Ahead a;
    a.base = ahead.base + t * share;
    a.bytes = std::max<int64_t>(0, std::min(share, ahead.bytes - t * share));
    a.per_block = (a.bytes / xblocks + 63) / 64 * 64;
    return a;
  };
  for (; row + 4 <= p.m; row += 4) tile<4, C, BITS>(p, row, block, part(row / 4));
  switch (p.m - row) {
    case 3: tile<3, C, BITS>(p, row, block, part(row / 4)); break;
    case 2: tile<2, C, BITS>(p, row, block, part(row / 4)); break;
    case 1: tile<1, C, BITS>(p, row, block, part(row / 4)); break;
    default: break;
  }
}

// What the tiles of blocks [block, block + count) prefetch: the next `count` blocks' weights, up to ahead_end, as
// prefetches spread over their blocks of 32 inputs, and those blocks' scales and offsets (two more streams, which the
// hardware prefetcher does not follow either) at once.
template <int BITS>
TIDAL_TARGET Ahead ahead_of(const Problem& p, int64_t block, int64_t count, int64_t ahead_end) {
  Ahead ahead;
  const int64_t next = std::min<int64_t>(count, ahead_end - (block + count));
  if (next <= 0) return ahead;
  const int64_t line = block_bytes(p.k, BITS);
  ahead.base = reinterpret_cast<const char*>(p.w + (block + count) * line);
  ahead.bytes = next * line;
  ahead.per_block = (ahead.bytes / (p.k / kXBlock) + 63) / 64 * 64;
  const int64_t first = (block + count) * p.groups * kCols, bytes = next * p.groups * kCols * int64_t(sizeof(float));
  for (int64_t at = 0; at < bytes; at += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p.scales + first) + at, _MM_HINT_T1);
    if (p.offsets != nullptr) _mm_prefetch(reinterpret_cast<const char*>(p.offsets + first) + at, _MM_HINT_T1);
  }
  return ahead;
}

// One row: four column blocks at a time (their loads overlap and x's broadcasts are shared). Several rows: four
// rows by kRowsCols blocks, so each weight vector loaded feeds four rows and each x broadcast kRowsCols blocks.
//
// At one row the step is a stream of the weight from memory, and the hardware prefetcher alone does not keep
// it going: a tile reads four streams a few KB long each, which end about when the prefetcher has ramped up, so
// the tile's arithmetic and the next tile's reads take turns. Each tile prefetches the next four blocks
// (contiguous with its own) while it computes, up to ahead_end (claims.h): the small model's 49 int4 linears,
// cold, 2 threads, went from 6.4 to 5.3 ms a step (a plain sum over the same bytes: 3.7 ms), AVX2 host.
//
// Several rows: the first four-row tile of each block reads its weights from memory and the others from cache, so
// the tiles of one block prefetch the next block's weights between them (16 rows of SmolLM2-135M's int8 linears,
// one thread: the tiles waited on memory for a fifth of their time without).
template <int BITS>
TIDAL_TARGET void run_blocks(const Problem& p, int64_t begin, int64_t end, int64_t ahead_end) {
  if (p.m == 1) {
    int64_t block = begin;
    for (; block + 4 <= end; block += 4) tile<1, 4, BITS>(p, 0, block, ahead_of<BITS>(p, block, 4, ahead_end));
    for (; block < end; ++block) tile<1, 1, BITS>(p, 0, block);
    return;
  }
  int64_t block = begin;
  for (; block + kRowsCols <= end; block += kRowsCols)
    rows_by_blocks<kRowsCols, BITS>(p, block, ahead_of<BITS>(p, block, kRowsCols, ahead_end));
  for (; block < end; ++block) rows_by_blocks<1, BITS>(p, block);
}
