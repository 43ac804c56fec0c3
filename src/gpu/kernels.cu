// dspark reduction kernels.
//
// Compiled at run time by NVRTC for the GPU at hand (see src/gpu/nvrtc.rs). The source includes
// nothing -- no cuda_fp16.h, no cuda_bf16.h, no standard headers; f16 conversion is two inline
// PTX instructions and bf16 conversion is bit manipulation -- so that libnvrtc alone is
// enough to compile it (the PyPI wheel nvidia-cuda-nvrtc-cu12 on a machine without a GPU).
//
// The same file is also compiled as plain host C++ by the test suite (DSPARK_HOST_EMULATION,
// tests/gpu/host_harness.cpp), which runs every kernel with an emulated grid on the CPU and
// compares the result bit for bit with an independent Rust reference. Keep it valid C++17 for
// both compilers.
//
// Semantics (identical to the CPU kernels in src/reduce, see ReduceOp in src/types.rs):
// - integers: Sum and Prod wrap (computed in the unsigned type of the same width);
// - f16/bf16: converted to f32, the op is done in f32, the result is rounded once to
//   nearest-even (the `half` crate's results; bf16 bit-wise, f16 with the GPU's cvt
//   instructions, bit-wise in host emulation; NaN payloads of Sum/Prod are unspecified);
// - float Min/Max are commutative bit for bit: a NaN operand gives the canonical quiet NaN
//   (positive, only the quiet bit set), otherwise -0.0 < +0.0;
// - Avg reduces with Sum; dspark_finalize_<type> then divides once by the world size: integers
//   truncate toward zero, f16/bf16 divide in f32 and round once.
//
// Entry points (extern "C", so their names are stable):
//   dspark_reduce_inplace_<op>_<type>(T* dst, const T* src, u64 n)        dst[i] = dst[i] op src[i]
//   dspark_reduce_into_<op>_<type>(T* dst, const T* a, const T* b, u64 n) dst[i] = a[i] op b[i]
//   dspark_finalize_<type>(T* dst, u64 n, u64 world)                      dst[i] = dst[i] / world
// with <op> in sum prod min max and <type> in i8 u8 i32 u32 i64 u64 f16 bf16 f32 f64.
//
// Memory access: 16-byte vector loads and stores where every pointer has the same offset modulo
// 16, with a scalar head (up to the first 16-byte boundary) and a scalar tail; plain scalar
// accesses otherwise. Grid-stride loops, so any grid size covers any length. Pointers must be
// aligned to their element size (the host side checks this before launching).

#if defined(DSPARK_HOST_EMULATION)
// The harness defines threadIdx, blockIdx, blockDim, gridDim, uint4 and the bit-cast intrinsics.
#define DS_DEV inline
#define DS_GLOBAL extern "C" void
#else
#define DS_DEV __device__ __forceinline__
#define DS_GLOBAL extern "C" __global__ void __launch_bounds__(256)
#endif

typedef unsigned long long ds_u64;
typedef long long ds_i64;

// ---------------------------------------------------------------------------------------------
// Bit-wise f16 / bf16 conversions (no cuda_fp16.h).

DS_DEV float ds_f16_to_f32_bits(unsigned short h) {
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    const unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
    const unsigned int man = (unsigned int)h & 0x3ffu;
    if (exp == 0x1fu) {
        // Infinity, or NaN with the quiet bit set and the payload kept.
        return __uint_as_float(sign | 0x7f800000u | (man != 0u ? 0x00400000u : 0u) | (man << 13));
    }
    if (exp == 0u) {
        // Zero or subnormal: man * 2^-24 is exact in f32 (a normal f32, never flushed).
        const float mag = (float)man * 5.9604644775390625e-8f;
        return __uint_as_float(sign | __float_as_uint(mag));
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

DS_DEV unsigned short ds_f32_to_f16_bits(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int exp = (x >> 23) & 0xffu;
    unsigned int man = x & 0x7fffffu;
    if (exp == 0xffu) {
        return (unsigned short)(sign | 0x7c00u | (man != 0u ? 0x0200u : 0u) | (man >> 13));
    }
    const int e = (int)exp - 127 + 15;
    if (e >= 0x1f) {
        return (unsigned short)(sign | 0x7c00u);
    }
    if (e <= 0) {
        if (14 - e > 24) {
            return (unsigned short)sign;
        }
        man |= 0x800000u;
        const unsigned int shift = (unsigned int)(14 - e);
        unsigned int hm = man >> shift;
        const unsigned int rem = man & ((1u << shift) - 1u);
        const unsigned int halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (hm & 1u) != 0u)) {
            hm += 1u;
        }
        return (unsigned short)(sign | hm);
    }
    unsigned int h = sign | ((unsigned int)e << 10) | (man >> 13);
    const unsigned int rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0u)) {
        h += 1u;  // a carry into the exponent is correct, up to infinity
    }
    return (unsigned short)h;
}

// On the GPU, f16 converts with the hardware's cvt instructions (exact widening; narrowing
// rounds to nearest-even, keeps subnormals, overflows to infinity: the same results as the
// bit-wise code above, which the host emulation runs, except NaN payloads -- which only Min/Max
// pin down, and they never convert a NaN back: see DsF16). DSPARK_F16_BITWISE forces the
// bit-wise code on the GPU too.
#if defined(DSPARK_HOST_EMULATION) || defined(DSPARK_F16_BITWISE)
DS_DEV float ds_f16_to_f32(unsigned short h) { return ds_f16_to_f32_bits(h); }
DS_DEV unsigned short ds_f32_to_f16(float f) { return ds_f32_to_f16_bits(f); }
#else
DS_DEV float ds_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
DS_DEV unsigned short ds_f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

DS_DEV float ds_bf16_to_f32(unsigned short h) {
    unsigned int b = (unsigned int)h;
    if ((b & 0x7fffu) > 0x7f80u) {
        b |= 0x0040u;  // NaN: set the quiet bit
    }
    return __uint_as_float(b << 16);
}

DS_DEV unsigned short ds_f32_to_bf16(float f) {
    const unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x0040u);
    }
    const unsigned int lsb = (x >> 16) & 1u;
    return (unsigned short)((x + 0x7fffu + lsb) >> 16);
}

// ---------------------------------------------------------------------------------------------
// Float min/max, commutative bit for bit.

DS_DEV float ds_min_f32(float a, float b) {
    if (a != a || b != b) return __uint_as_float(0x7fc00000u);
    if (a < b) return a;
    if (b < a) return b;
    return __uint_as_float(__float_as_uint(a) | __float_as_uint(b));  // equal: -0 wins
}

DS_DEV float ds_max_f32(float a, float b) {
    if (a != a || b != b) return __uint_as_float(0x7fc00000u);
    if (a > b) return a;
    if (b > a) return b;
    return __uint_as_float(__float_as_uint(a) & __float_as_uint(b));  // equal: +0 wins
}

DS_DEV double ds_min_f64(double a, double b) {
    if (a != a || b != b) return __longlong_as_double((ds_i64)0x7ff8000000000000ull);
    if (a < b) return a;
    if (b < a) return b;
    return __longlong_as_double(__double_as_longlong(a) | __double_as_longlong(b));
}

DS_DEV double ds_max_f64(double a, double b) {
    if (a != a || b != b) return __longlong_as_double((ds_i64)0x7ff8000000000000ull);
    if (a > b) return a;
    if (b > a) return b;
    return __longlong_as_double(__double_as_longlong(a) & __double_as_longlong(b));
}

// ---------------------------------------------------------------------------------------------
// Element types: storage type S and the five scalar operations.

template <class T, class U, bool SIGNED>
struct DsInt {
    typedef T S;
    static DS_DEV S sum(S a, S b) { return (S)(U)((U)a + (U)b); }
    static DS_DEV S prod(S a, S b) { return (S)(U)((U)a * (U)b); }
    static DS_DEV S min(S a, S b) { return b < a ? b : a; }
    static DS_DEV S max(S a, S b) { return a < b ? b : a; }
    static DS_DEV S fin(S x, ds_u64 world) {
        if (SIGNED) {
            return (S)((ds_i64)x / (ds_i64)world);  // truncates toward zero
        }
        return (S)((ds_u64)x / world);
    }
};

struct DsF32 {
    typedef float S;
    static DS_DEV S sum(S a, S b) { return a + b; }
    static DS_DEV S prod(S a, S b) { return a * b; }
    static DS_DEV S min(S a, S b) { return ds_min_f32(a, b); }
    static DS_DEV S max(S a, S b) { return ds_max_f32(a, b); }
    static DS_DEV S fin(S x, ds_u64 world) { return x / (float)world; }
};

struct DsF64 {
    typedef double S;
    static DS_DEV S sum(S a, S b) { return a + b; }
    static DS_DEV S prod(S a, S b) { return a * b; }
    static DS_DEV S min(S a, S b) { return ds_min_f64(a, b); }
    static DS_DEV S max(S a, S b) { return ds_max_f64(a, b); }
    static DS_DEV S fin(S x, ds_u64 world) { return x / (double)world; }
};

// Min/Max of 16-bit floats compare in f32 and return one operand's bits (exact, no rounding),
// the canonical quiet NaN (QNAN) when either is NaN, and for equal operands -0 < +0.
template <unsigned short QNAN>
struct DsHalfMinMax {
    static DS_DEV unsigned short min(float x, float y, unsigned short a, unsigned short b) {
        if (x != x || y != y) return QNAN;
        if (x < y) return a;
        if (y < x) return b;
        return (unsigned short)(a | b);  // equal: the same bits, or +0/-0 where -0 wins
    }
    static DS_DEV unsigned short max(float x, float y, unsigned short a, unsigned short b) {
        if (x != x || y != y) return QNAN;
        if (x > y) return a;
        if (y > x) return b;
        return (unsigned short)(a & b);  // equal: the same bits, or +0/-0 where +0 wins
    }
};

struct DsF16 {
    typedef unsigned short S;
    static DS_DEV float up(S a) { return ds_f16_to_f32(a); }
    static DS_DEV S down(float f) { return ds_f32_to_f16(f); }
    static DS_DEV S sum(S a, S b) { return down(up(a) + up(b)); }
    static DS_DEV S prod(S a, S b) { return down(up(a) * up(b)); }
    static DS_DEV S min(S a, S b) { return DsHalfMinMax<0x7e00>::min(up(a), up(b), a, b); }
    static DS_DEV S max(S a, S b) { return DsHalfMinMax<0x7e00>::max(up(a), up(b), a, b); }
    static DS_DEV S fin(S x, ds_u64 world) { return down(up(x) / (float)world); }
};

struct DsBF16 {
    typedef unsigned short S;
    static DS_DEV float up(S a) { return ds_bf16_to_f32(a); }
    static DS_DEV S down(float f) { return ds_f32_to_bf16(f); }
    static DS_DEV S sum(S a, S b) { return down(up(a) + up(b)); }
    static DS_DEV S prod(S a, S b) { return down(up(a) * up(b)); }
    static DS_DEV S min(S a, S b) { return DsHalfMinMax<0x7fc0>::min(up(a), up(b), a, b); }
    static DS_DEV S max(S a, S b) { return DsHalfMinMax<0x7fc0>::max(up(a), up(b), a, b); }
    static DS_DEV S fin(S x, ds_u64 world) { return down(up(x) / (float)world); }
};

typedef DsInt<signed char, unsigned char, true> DsI8;
typedef DsInt<unsigned char, unsigned char, false> DsU8;
typedef DsInt<int, unsigned int, true> DsI32;
typedef DsInt<unsigned int, unsigned int, false> DsU32;
typedef DsInt<ds_i64, ds_u64, true> DsI64;
typedef DsInt<ds_u64, ds_u64, false> DsU64;

struct DsOpSum {
    template <class Ty>
    static DS_DEV typename Ty::S ap(typename Ty::S a, typename Ty::S b) { return Ty::sum(a, b); }
};
struct DsOpProd {
    template <class Ty>
    static DS_DEV typename Ty::S ap(typename Ty::S a, typename Ty::S b) { return Ty::prod(a, b); }
};
struct DsOpMin {
    template <class Ty>
    static DS_DEV typename Ty::S ap(typename Ty::S a, typename Ty::S b) { return Ty::min(a, b); }
};
struct DsOpMax {
    template <class Ty>
    static DS_DEV typename Ty::S ap(typename Ty::S a, typename Ty::S b) { return Ty::max(a, b); }
};

// ---------------------------------------------------------------------------------------------
// Loop bodies.

template <class S>
union DsPack {
    uint4 v;
    S e[16 / sizeof(S)];
};

template <class P>
DS_DEV ds_u64 ds_addr(const P* p) {
    return (ds_u64)(const void*)p;
}

DS_DEV ds_u64 ds_tid() { return (ds_u64)blockIdx.x * (ds_u64)blockDim.x + (ds_u64)threadIdx.x; }
DS_DEV ds_u64 ds_stride() { return (ds_u64)gridDim.x * (ds_u64)blockDim.x; }

// dst[i] = a[i] op b[i]; dst may be the same array as a (in place) but must not partially overlap.
template <class Ty, class Op>
DS_DEV void ds_reduce_body(typename Ty::S* dst, const typename Ty::S* a, const typename Ty::S* b,
                           ds_u64 n) {
    typedef typename Ty::S S;
    const ds_u64 V = 16 / sizeof(S);
    const ds_u64 tid = ds_tid();
    const ds_u64 stride = ds_stride();
    const ds_u64 mis = ds_addr(dst) & 15u;
    ds_u64 head = n;  // all scalar unless the three pointers share their offset modulo 16
    if ((ds_addr(a) & 15u) == mis && (ds_addr(b) & 15u) == mis && mis % sizeof(S) == 0) {
        head = mis == 0 ? 0 : (16u - mis) / sizeof(S);
        if (head > n) head = n;
    }
    for (ds_u64 i = tid; i < head; i += stride) {
        dst[i] = Op::template ap<Ty>(a[i], b[i]);
    }
    const ds_u64 nv = (n - head) / V;
    const uint4* av = (const uint4*)(const void*)(a + head);
    const uint4* bv = (const uint4*)(const void*)(b + head);
    uint4* dv = (uint4*)(void*)(dst + head);
    for (ds_u64 i = tid; i < nv; i += stride) {
        DsPack<S> pa, pb, pd;
        pa.v = av[i];
        pb.v = bv[i];
#pragma unroll
        for (ds_u64 k = 0; k < V; ++k) {
            pd.e[k] = Op::template ap<Ty>(pa.e[k], pb.e[k]);
        }
        dv[i] = pd.v;
    }
    for (ds_u64 i = head + nv * V + tid; i < n; i += stride) {
        dst[i] = Op::template ap<Ty>(a[i], b[i]);
    }
}

template <class Ty>
DS_DEV void ds_finalize_body(typename Ty::S* dst, ds_u64 n, ds_u64 world) {
    typedef typename Ty::S S;
    const ds_u64 V = 16 / sizeof(S);
    const ds_u64 tid = ds_tid();
    const ds_u64 stride = ds_stride();
    const ds_u64 mis = ds_addr(dst) & 15u;
    ds_u64 head = n;
    if (mis % sizeof(S) == 0) {
        head = mis == 0 ? 0 : (16u - mis) / sizeof(S);
        if (head > n) head = n;
    }
    for (ds_u64 i = tid; i < head; i += stride) {
        dst[i] = Ty::fin(dst[i], world);
    }
    const ds_u64 nv = (n - head) / V;
    uint4* dv = (uint4*)(void*)(dst + head);
    for (ds_u64 i = tid; i < nv; i += stride) {
        DsPack<S> p;
        p.v = dv[i];
#pragma unroll
        for (ds_u64 k = 0; k < V; ++k) {
            p.e[k] = Ty::fin(p.e[k], world);
        }
        dv[i] = p.v;
    }
    for (ds_u64 i = head + nv * V + tid; i < n; i += stride) {
        dst[i] = Ty::fin(dst[i], world);
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points. The Rust side (src/gpu/kernels.rs) lists the same names.

#define DS_REDUCE_ENTRIES(OPNAME, OP, TYNAME, TY)                                                  \
    DS_GLOBAL dspark_reduce_inplace_##OPNAME##_##TYNAME(TY::S* dst, const TY::S* src, ds_u64 n) { \
        ds_reduce_body<TY, OP>(dst, dst, src, n);                                                  \
    }                                                                                              \
    DS_GLOBAL dspark_reduce_into_##OPNAME##_##TYNAME(TY::S* dst, const TY::S* a, const TY::S* b,  \
                                                     ds_u64 n) {                                   \
        ds_reduce_body<TY, OP>(dst, a, b, n);                                                      \
    }

#define DS_TYPE_ENTRIES(TYNAME, TY)                                                 \
    DS_REDUCE_ENTRIES(sum, DsOpSum, TYNAME, TY)                                     \
    DS_REDUCE_ENTRIES(prod, DsOpProd, TYNAME, TY)                                   \
    DS_REDUCE_ENTRIES(min, DsOpMin, TYNAME, TY)                                     \
    DS_REDUCE_ENTRIES(max, DsOpMax, TYNAME, TY)                                     \
    DS_GLOBAL dspark_finalize_##TYNAME(TY::S* dst, ds_u64 n, ds_u64 world) {        \
        ds_finalize_body<TY>(dst, n, world);                                        \
    }

DS_TYPE_ENTRIES(i8, DsI8)
DS_TYPE_ENTRIES(u8, DsU8)
DS_TYPE_ENTRIES(i32, DsI32)
DS_TYPE_ENTRIES(u32, DsU32)
DS_TYPE_ENTRIES(i64, DsI64)
DS_TYPE_ENTRIES(u64, DsU64)
DS_TYPE_ENTRIES(f16, DsF16)
DS_TYPE_ENTRIES(bf16, DsBF16)
DS_TYPE_ENTRIES(f32, DsF32)
DS_TYPE_ENTRIES(f64, DsF64)
