// The int8/int4 linear's loops, written once over a 16-float vector `V` and compiled once per instruction set:
// linear_int.cpp includes this file in namespace avx2 (V = two __m256) and in namespace avx512 (V = one
// __m512), each after defining TIDAL_TARGET and the primitives below, so both paths run the same algorithm.
//
//   V zero(); V splat(float); V load(const float* p16); V fmadd(V a, V b, V c) (a*b+c); V fmsub(a, b, c) (a*b-c);
//   V add(V a, V b); V widen_i8(const int8_t* p16) (16 int8 to float); U4 load_u4(const uint8_t* p64) (an int4
//   chunk); V nibbles(U4 v, int shift) (each column's 32-bit lane >> shift & 0xF, as floats 0..15);
//   void store(float* dst, V v, int64_t valid).
//
// No include guard: it is meant to be included once per namespace.

// Rows [row, row + ROWS) by the 16 columns of `block`. FACTORED (int8 with no offsets): the weights enter the
// sums as integers and each column's scale multiplies the sum once at the end; otherwise every weight is
// dequantized (q * scale - offset, one FMA) once per group of inputs and feeds all ROWS rows. With one row,
// two sets of sums (even and odd inputs) keep enough FMA chains in flight.
template <int ROWS, int BITS, bool FACTORED>
TIDAL_TARGET __attribute__((noinline)) void tile(const Problem& p, int64_t row, int64_t block) {
  constexpr int S = ROWS == 1 ? 2 : 1;
  V acc[S][ROWS];
  _Pragma("GCC unroll 2") for (int s = 0; s < S; ++s)
    _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) acc[s][r] = zero();
  const float* x = p.x + row * p.x_stride;
  const float* scales = p.scales + block * p.groups * kBlock;
  const float* offsets = p.offsets == nullptr ? nullptr : p.offsets + block * p.groups * kBlock;
  if constexpr (BITS == 8) {
    const int8_t* w = reinterpret_cast<const int8_t*>(p.w) + block * p.k * kBlock;
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t first = g * p.group_size, last = std::min(p.k, first + p.group_size);
      V scale = zero(), offset = zero();
      if constexpr (!FACTORED) {
        scale = load(scales + g * kBlock);
        offset = load(offsets + g * kBlock);
      }
      int64_t i = first;
      for (; i + 2 <= last; i += 2) {
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
          V wv = widen_i8(w + (i + h) * kBlock);
          if constexpr (!FACTORED) wv = fmsub(wv, scale, offset);
          _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)
            acc[h % S][r] = fmadd(splat(x[r * p.x_stride + i + h]), wv, acc[h % S][r]);
        }
      }
      if (i < last) {  // an odd input left in the group
        V wv = widen_i8(w + i * kBlock);
        if constexpr (!FACTORED) wv = fmsub(wv, scale, offset);
        _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r)
          acc[0][r] = fmadd(splat(x[r * p.x_stride + i]), wv, acc[0][r]);
      }
    }
  } else {
    // a group's inputs in chunks of 8: column j's input 2t + h in bits 16h + 4t of its 32-bit lane
    const uint8_t* w = p.w + block * p.groups * p.chunks * 64;
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t first = g * p.group_size, size = std::min(p.k, first + p.group_size) - first;
      const V scale = load(scales + g * kBlock), offset = load(offsets + g * kBlock);
      const uint8_t* chunk = w + g * p.chunks * 64;
      for (int64_t i = 0; i < size; i += 8, chunk += 64) {
        const U4 v = load_u4(chunk);
        const int64_t pairs = std::min<int64_t>(4, (size - i) / 2);
        const float* xi = x + first + i;
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
          if (t >= pairs) break;
          const V even = fmsub(nibbles(v, 4 * t), scale, offset), odd = fmsub(nibbles(v, 16 + 4 * t), scale, offset);
          _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {
            acc[0][r] = fmadd(splat(xi[r * p.x_stride + 2 * t]), even, acc[0][r]);
            acc[S - 1][r] = fmadd(splat(xi[r * p.x_stride + 2 * t + 1]), odd, acc[S - 1][r]);
          }
        }
      }
    }
  }
  const int64_t col = block * kBlock;
  const int64_t valid = std::min<int64_t>(kBlock, p.n - col);
  V bias = zero();
  if (p.bias != nullptr) {
    float padded[kBlock] = {};
    std::copy(p.bias + col, p.bias + col + valid, padded);
    bias = load(padded);
  }
  const V scale = FACTORED ? load(scales) : zero();
  _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; ++r) {
    V y = acc[0][r];
    if constexpr (S == 2) y = add(y, acc[1][r]);
    y = FACTORED ? fmadd(y, scale, bias) : add(y, bias);
    store(p.out + (row + r) * p.n + col, y, valid);
  }
}

// Every row of x by blocks [begin, end): each block for all rows before the next, four rows a pass, so the passes
// after the first read the block's weights from cache.
template <int BITS, bool FACTORED>
TIDAL_TARGET void run_blocks(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t block = begin; block < end; ++block) {
    for (int64_t row = 0; row < p.m; row += 4) {
      switch (std::min<int64_t>(4, p.m - row)) {
        case 1: tile<1, BITS, FACTORED>(p, row, block); break;
        case 2: tile<2, BITS, FACTORED>(p, row, block); break;
        case 3: tile<3, BITS, FACTORED>(p, row, block); break;
        default: tile<4, BITS, FACTORED>(p, row, block); break;
      }
    }
  }
}

TIDAL_TARGET void run(const Problem& p, int64_t begin, int64_t end) {
  if (p.bits == 8 && p.offsets == nullptr) return run_blocks<8, true>(p, begin, end);
  if (p.bits == 8) return run_blocks<8, false>(p, begin, end);
  return run_blocks<4, false>(p, begin, end);
}
