// Runs dspark's CUDA reduction kernels (src/gpu/kernels.cu) on the CPU with an emulated grid.
//
// The kernels are element-wise (no shared memory, no synchronisation), so running every thread
// of every block one after another gives exactly what the GPU computes -- including any bug in
// the head / vector body / tail split, where an element would be done twice or not at all.
//
// Built and driven by tests/gpu_kernels_compile.rs:
//   c++ -std=c++17 -O1 -ffp-contract=off -rdynamic tests/gpu/host_harness.cpp -o harness -ldl
//   harness <cases-file> <results-file>
//
// Cases file: a sequence of records, all integers little-endian u64:
//   name_len, name bytes, kind (0 inplace, 1 into, 2 finalize, 3 into with a == dst),
//   elem_size, n, off_dst, off_a, off_b (in elements), world, grid, block,
//   then three buffers (dst, a, b), each as byte length + bytes.
// Results file: for each record, the dst buffer after the kernel, as byte length + bytes.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <string>
#include <vector>

struct DsDim3 {
    unsigned int x, y, z;
};
static DsDim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline long long __double_as_longlong(double d) {
    long long u;
    std::memcpy(&u, &d, 8);
    return u;
}
static inline double __longlong_as_double(long long u) {
    double d;
    std::memcpy(&d, &u, 8);
    return d;
}

#define DSPARK_HOST_EMULATION 1
#include "../../src/gpu/kernels.cu"

typedef void (*Inplace)(void*, const void*, unsigned long long);
typedef void (*Into)(void*, const void*, const void*, unsigned long long);
typedef void (*Finalize)(void*, unsigned long long, unsigned long long);

static bool read_u64(FILE* f, uint64_t* v) {
    unsigned char b[8];
    if (std::fread(b, 1, 8, f) != 8) return false;
    *v = 0;
    for (int i = 7; i >= 0; --i) *v = (*v << 8) | b[i];
    return true;
}

static void write_u64(FILE* f, uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = (unsigned char)(v >> (8 * i));
    std::fwrite(b, 1, 8, f);
}

struct Buf {
    unsigned char* p = nullptr;
    uint64_t len = 0;
    ~Buf() { std::free(p); }
};

static bool read_buf(FILE* f, Buf* b) {
    if (!read_u64(f, &b->len)) return false;
    // 64-byte aligned so that element offsets decide the alignment seen by the kernel.
    b->p = (unsigned char*)std::aligned_alloc(64, ((b->len + 63) / 64) * 64 + 64);
    if (!b->p) return false;
    return b->len == 0 || std::fread(b->p, 1, b->len, f) == b->len;
}

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s <cases> <results>\n", argv[0]);
        return 2;
    }
    FILE* in = std::fopen(argv[1], "rb");
    FILE* out = std::fopen(argv[2], "wb");
    if (!in || !out) {
        std::perror("open");
        return 2;
    }
    uint64_t name_len;
    int count = 0;
    while (read_u64(in, &name_len)) {
        std::string name(name_len, '\0');
        if (std::fread(&name[0], 1, name_len, in) != name_len) return 3;
        uint64_t kind, es, n, od, oa, ob, world, grid, block;
        if (!read_u64(in, &kind) || !read_u64(in, &es) || !read_u64(in, &n) || !read_u64(in, &od) ||
            !read_u64(in, &oa) || !read_u64(in, &ob) || !read_u64(in, &world) || !read_u64(in, &grid) ||
            !read_u64(in, &block))
            return 3;
        Buf d, a, b;
        if (!read_buf(in, &d) || !read_buf(in, &a) || !read_buf(in, &b)) return 3;
        void* sym = dlsym(RTLD_DEFAULT, name.c_str());
        if (!sym) {
            std::fprintf(stderr, "kernel %s not found\n", name.c_str());
            return 4;
        }
        void* pd = d.p + od * es;
        const void* pa = a.p + oa * es;
        const void* pb = b.p + ob * es;
        gridDim.x = (unsigned)grid;
        blockDim.x = (unsigned)block;
        gridDim.y = gridDim.z = blockDim.y = blockDim.z = 1;
        for (uint64_t bx = 0; bx < grid; ++bx) {
            for (uint64_t tx = 0; tx < block; ++tx) {
                blockIdx.x = (unsigned)bx;
                threadIdx.x = (unsigned)tx;
                switch (kind) {
                    case 0: ((Inplace)sym)(pd, pb, n); break;
                    case 1: ((Into)sym)(pd, pa, pb, n); break;
                    case 2: ((Finalize)sym)(pd, n, world); break;
                    case 3: ((Into)sym)(pd, pd, pb, n); break;
                    default: return 5;
                }
            }
        }
        write_u64(out, d.len);
        std::fwrite(d.p, 1, d.len, out);
        ++count;
    }
    std::fclose(out);
    std::fclose(in);
    std::fprintf(stderr, "host_harness: ran %d cases\n", count);
    return 0;
}
