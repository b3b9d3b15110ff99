// Every primitive of worker/kernels/isa_neon.h checked against worker/kernels/isa_portable.h (the
// reference) on random inputs, without torch: both headers, unmodified, are included into one
// translation unit under two namespaces (llmpool_neon, llmpool_portable), with the includes vec.h
// gives them and stand-ins for c10::BFloat16 / c10::Half (tests/arm/stub). Integer dot products,
// loads, store_i8, add/sub/mul/div/max are compared bit for bit; fma and hsum within rounding;
// exp16 within 2e-7 relative (and ~0 below -87, where both x86 variants give ~1e-38 too).
//
// Built for aarch64 and run under qemu by scripts/arm_check.sh (qemu -cpu max: sdot needs dotprod),
// once with the neon variant's flags and once with neon_i8mm's (+i8mm: the smmla row pairs too).
// Usage: neon_vs_portable [trials] [seed]. Last line: "N passed, M failed"; exit status 1 on failure.
#if !(defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD))
#error "build with an aarch64 compiler and -march=armv8.2-a+dotprod (see scripts/arm_check.sh)"
#endif

// What vec.h includes before the ISA header (the torch ones replaced by the stubs).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#define llmpool llmpool_neon
#include "isa_neon.h"
#undef llmpool
#define llmpool llmpool_portable
#include "isa_portable.h"
#undef llmpool

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>

// The same calls on either ISA, on plain arrays (each result stored with store16, checked first).
#define LLMPOOL_ISA_API(NS)                                                                         \
  struct NS##_api {                                                                                \
    using V = NS::V16;                                                                             \
    static constexpr int shift = NS::ACTIVATION_SHIFT;                                             \
    template <typename T>                                                                          \
    static void load(const T* p, float* o) { NS::store16(o, NS::load16(p)); }                      \
    static void splat(float x, float* o) { NS::store16(o, V::splat(x)); }                          \
    static void zero(float* o) { NS::store16(o, V::zero()); }                                      \
    static void fma(const float* a, const float* b, const float* c, float* o) {                   \
      NS::store16(o, NS::fma(NS::load16(a), NS::load16(b), NS::load16(c)));                        \
    }                                                                                              \
    static void mul(const float* a, const float* b, float* o) { NS::store16(o, NS::mul(NS::load16(a), NS::load16(b))); } \
    static void add(const float* a, const float* b, float* o) { NS::store16(o, NS::add(NS::load16(a), NS::load16(b))); } \
    static void sub(const float* a, const float* b, float* o) { NS::store16(o, NS::sub(NS::load16(a), NS::load16(b))); } \
    static void div(const float* a, const float* b, float* o) { NS::store16(o, NS::div(NS::load16(a), NS::load16(b))); } \
    static void vmax(const float* a, const float* b, float* o) { NS::store16(o, NS::vmax(NS::load16(a), NS::load16(b))); } \
    static void vabs(const float* a, const float* b, float* o) { (void)b; NS::store16(o, NS::vabs(NS::load16(a))); } \
    static void exp16(const float* a, const float* b, float* o) { (void)b; NS::store16(o, NS::exp16(NS::load16(a))); } \
    static float hsum(const float* a) { return NS::hsum(NS::load16(a)); }                          \
    static float hmax(const float* a) { return NS::hmax(NS::load16(a)); }                          \
    static void reduce16(const float* a, float* o) {                                               \
      V r[16];                                                                                     \
      for (int i = 0; i < 16; ++i) r[i] = NS::load16(a + 16 * i);                                  \
      NS::store16(o, NS::reduce16(r));                                                             \
    }                                                                                              \
    static void store_i8(const float* a, int8_t* o) { NS::store_i8(o, NS::load16(a)); }            \
    /* acc_zero, then one dot_s8 per 64 weight bytes and activation word: the sums and acc_float */ \
    static void dot_s8(const int8_t* w, const int32_t* four, int steps, int32_t* sums, float* f) { \
      NS::Acc16 acc = NS::acc_zero();                                                              \
      for (int s = 0; s < steps; ++s) acc = NS::dot_s8(acc, NS::load_s8w(w + 64 * s), four[s]);    \
      static_assert(sizeof(acc) == 64, "16 int32");                                                \
      std::memcpy(sums, &acc, 64);                                                                 \
      NS::store16(f, NS::acc_float(acc));                                                          \
    }                                                                                              \
    static void dot_q4(const uint8_t* w, const int32_t* x, int steps, int32_t* sums, float* f) {   \
      NS::Q4Acc acc = NS::q4_zero();                                                               \
      for (int s = 0; s < steps; ++s) acc = NS::dot_q4(acc, NS::load_q4w(w + 64 * s), x[2 * s], x[2 * s + 1]); \
      static_assert(sizeof(acc) == 64, "16 int32");                                                \
      std::memcpy(sums, &acc, 64);                                                                 \
      NS::store16(f, NS::q4_float(acc));                                                           \
    }                                                                                              \
  };
LLMPOOL_ISA_API(llmpool_neon)
LLMPOOL_ISA_API(llmpool_portable)
using Neon = llmpool_neon_api;
using Ref = llmpool_portable_api;

namespace {

std::mt19937 rng;
int passed = 0, failed = 0;

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
uint32_t bits32() { return static_cast<uint32_t>(rng()); }
float from_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
uint32_t to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// A float from a mix of ranges: ordinary magnitudes, tiny and huge ones, exact specials.
float any_float() {
  switch (rng() % 8) {
    case 0: return uniform(-1.f, 1.f);
    case 1: return uniform(-1000.f, 1000.f);
    case 2: return std::ldexp(uniform(-1.f, 1.f), static_cast<int>(rng() % 250) - 125);
    case 3: {  // any finite bit pattern
      float f;
      do f = from_bits(bits32()); while (!std::isfinite(f));
      return f;
    }
    case 4: {
      static const float special[] = {0.f, -0.f, 1.f, -1.f, 0.5f, std::numeric_limits<float>::min(),
                                      std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
                                      -std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                                      -std::numeric_limits<float>::infinity()};
      return special[rng() % (sizeof(special) / sizeof(float))];
    }
    default: return uniform(-10.f, 10.f);
  }
}

// Bit for bit, except that any NaN matches any NaN (payloads are not compared).
bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || to_bits(a) == to_bits(b); }

// isa_avx2.h's exp8, one lane in scalar code (std::fma for its fused multiply-adds): NEON's exp16
// must give the same bits, so the variants agree wherever the kernels use it (softmax).
float x86_exp(float x) {
  const float t = std::max(x, -100.f) * 1.44269504088896341f;
  const float n = std::nearbyint(t), f = t - n;
  float p = 1.5403530393381606e-4f;
  for (float k : {1.3333558146428443e-3f, 9.6181291076284772e-3f, 5.5504108664821580e-2f, 2.4022650695910071e-1f,
                  6.9314718055994531e-1f, 1.f})
    p = std::fma(p, f, k);
  const int32_t e = std::clamp(static_cast<int32_t>(n), -126, 127);
  return p * from_bits(static_cast<uint32_t>(e + 127) << 23);
}

struct Check {
  std::string name;
  long cases = 0, bad = 0;
  double worst = 0;  // largest relative error seen (the rounding-tolerant checks)
  explicit Check(std::string n) : name(std::move(n)) {}
  // Records one case; prints the first few mismatches.
  void expect(bool ok, const char* what, double got, double want, double input = NAN) {
    ++cases;
    if (ok) return;
    if (++bad <= 5)
      std::printf("  %s: %s: neon %.9g, portable %.9g (input %.9g)\n", name.c_str(), what, got, want, input);
  }
  ~Check() {
    const bool ok = bad == 0 && cases > 0;
    (ok ? passed : failed) += 1;
    std::printf("%-6s %-22s %8ld cases", ok ? "PASS" : "FAIL", name.c_str(), cases);
    if (bad) std::printf(", %ld wrong", bad);
    if (worst > 0) std::printf(", worst relative error %.3g", worst);
    std::printf("\n");
  }
};

void fill(float* p, int n, const std::function<float()>& gen) { for (int i = 0; i < n; ++i) p[i] = gen(); }

void check_loads(int trials) {
  {
    Check c("load16/store16 float");
    for (int t = 0; t < trials; ++t) {
      float in[17], a[16], b[16];
      fill(in, 17, any_float);
      const float* p = in + (t & 1);  // unaligned every other time
      Neon::load(p, a);
      Ref::load(p, b);
      for (int i = 0; i < 16; ++i) c.expect(same(a[i], b[i]) && same(a[i], p[i]), "lane", a[i], b[i]);
    }
  }
  {
    Check c("load16 bf16");
    for (int t = 0; t < trials; ++t) {
      c10::BFloat16 in[17];
      float a[16], b[16];
      for (auto& x : in) x.x = static_cast<uint16_t>(rng());
      Neon::load(in + (t & 1), a);
      Ref::load(in + (t & 1), b);
      for (int i = 0; i < 16; ++i) c.expect(same(a[i], b[i]), "lane", a[i], b[i], in[(t & 1) + i].x);
    }
  }
  {
    Check c("load16 half");
    for (int t = 0; t < trials; ++t) {
      c10::Half in[17];
      float a[16], b[16];
      for (auto& x : in) x.x = static_cast<uint16_t>(rng());
      Neon::load(in + (t & 1), a);
      Ref::load(in + (t & 1), b);
      for (int i = 0; i < 16; ++i) c.expect(same(a[i], b[i]), "lane", a[i], b[i], in[(t & 1) + i].x);
    }
    for (uint32_t base = 0; base < 65536; base += 16) {  // and every bit pattern once
      c10::Half in[16];
      float a[16], b[16];
      for (int i = 0; i < 16; ++i) in[i].x = static_cast<uint16_t>(base + i);
      Neon::load(in, a);
      Ref::load(in, b);
      for (int i = 0; i < 16; ++i) c.expect(same(a[i], b[i]), "bits", a[i], b[i], in[i].x);
    }
  }
  {
    Check c("load16 int8");
    for (int t = 0; t < trials; ++t) {
      int8_t in[17];
      float a[16], b[16];
      for (auto& x : in) x = static_cast<int8_t>(rng());
      Neon::load(in + (t & 1), a);
      Ref::load(in + (t & 1), b);
      for (int i = 0; i < 16; ++i) c.expect(same(a[i], b[i]), "lane", a[i], b[i], in[(t & 1) + i]);
    }
  }
  {
    Check c("splat/zero");
    for (int t = 0; t < trials; ++t) {
      const float x = any_float();
      float a[16], b[16], za[16], zb[16];
      Neon::splat(x, a);
      Ref::splat(x, b);
      Neon::zero(za);
      Ref::zero(zb);
      for (int i = 0; i < 16; ++i) {
        c.expect(same(a[i], b[i]) && same(a[i], x), "splat", a[i], b[i], x);
        c.expect(same(za[i], zb[i]) && to_bits(za[i]) == 0, "zero", za[i], zb[i]);
      }
    }
  }
}

using Binary = void (*)(const float*, const float*, float*);

// A lane-wise operation, compared bit for bit (or with `equal`: == , so +0 matches -0).
void check_binary(const char* name, Binary neon, Binary ref, int trials, bool equal = false, bool positive_b = false) {
  Check c(name);
  for (int t = 0; t < trials; ++t) {
    float a[16], b[16], x[16], y[16];
    fill(a, 16, any_float);
    fill(b, 16, any_float);
    if (positive_b) for (float& v : b) v = std::fabs(v);
    neon(a, b, x);
    ref(a, b, y);
    for (int i = 0; i < 16; ++i) c.expect(equal ? (x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i]))) : same(x[i], y[i]), "lane", x[i], y[i], a[i]);
  }
}

void check_float_ops(int trials) {
  check_binary("mul", Neon::mul, Ref::mul, trials);
  check_binary("add", Neon::add, Ref::add, trials);
  check_binary("sub", Neon::sub, Ref::sub, trials);
  check_binary("div", Neon::div, Ref::div, trials);
  check_binary("vmax", Neon::vmax, Ref::vmax, trials, true);
  check_binary("vabs", Neon::vabs, Ref::vabs, trials);
  {
    // One rounding (NEON's fused multiply-add) against the portable loop (fused or not, as the
    // compiler contracts it): within half an ulp of |a*b| plus one of the result.
    Check c("fma");
    for (int t = 0; t < trials; ++t) {
      float a[16], b[16], d[16], x[16], y[16];
      for (int i = 0; i < 16; ++i) a[i] = uniform(-100.f, 100.f), b[i] = uniform(-100.f, 100.f), d[i] = uniform(-1e4f, 1e4f);
      if (t % 4 == 0) for (int i = 0; i < 16; ++i) d[i] = -a[i] * b[i];  // cancellation
      Neon::fma(a, b, d, x);
      Ref::fma(a, b, d, y);
      for (int i = 0; i < 16; ++i) {
        const double exact = static_cast<double>(a[i]) * b[i] + d[i];
        const double tol = 1.2e-7 * (std::fabs(static_cast<double>(a[i]) * b[i]) + std::fabs(exact)) + 1e-30;
        c.expect(std::fabs(x[i] - exact) <= tol && std::fabs(x[i] - y[i]) <= 2 * tol, "lane", x[i], y[i], a[i]);
        // NEON's vfmaq is fused: exactly the correctly rounded a*b+d.
        c.expect(x[i] == static_cast<float>(exact), "fused", x[i], static_cast<float>(exact), a[i]);
      }
    }
  }
  {
    Check c("hsum");
    for (int t = 0; t < trials; ++t) {
      float a[16];
      fill(a, 16, [] { return uniform(-1000.f, 1000.f); });
      const float x = Neon::hsum(a), y = Ref::hsum(a);
      double mag = 0;
      for (float v : a) mag += std::fabs(v);
      c.expect(std::fabs(x - y) <= 4 * 1.2e-7 * mag, "sum", x, y);
      c.expect(same(x, y), "same order", x, y);  // same adds in the same order: the same bits
    }
  }
  {
    Check c("hmax");
    for (int t = 0; t < trials; ++t) {
      float a[16];
      fill(a, 16, any_float);
      c.expect(same(Neon::hmax(a), Ref::hmax(a)) || Neon::hmax(a) == Ref::hmax(a), "max", Neon::hmax(a), Ref::hmax(a));
    }
  }
  {
    Check c("reduce16");
    for (int t = 0; t < trials / 4 + 1; ++t) {
      float a[256], x[16], y[16];
      fill(a, 256, [] { return uniform(-1000.f, 1000.f); });
      Neon::reduce16(a, x);
      Ref::reduce16(a, y);
      for (int i = 0; i < 16; ++i) c.expect(same(x[i], y[i]), "lane", x[i], y[i]);
    }
  }
  {
    Check c("store_i8");
    for (int t = 0; t < trials; ++t) {
      float a[16];
      int8_t x[17], y[17];
      for (int i = 0; i < 16; ++i)
        a[i] = t % 3 == 0 ? std::round(uniform(-127.f, 127.f)) + (rng() % 2 ? 0.5f : -0.5f)  // ties
                          : uniform(-127.49f, 127.49f);
      if (t % 3 == 0) for (float& v : a) v = std::clamp(v, -126.5f, 126.5f);
      x[16] = y[16] = 0x55;
      Neon::store_i8(a, x);
      Ref::store_i8(a, y);
      for (int i = 0; i < 16; ++i) c.expect(x[i] == y[i], "lane", x[i], y[i], a[i]);
      c.expect(x[16] == 0x55, "wrote past 16 bytes", x[16], 0x55);
    }
  }
  {
    // Against std::exp: the error of t = x * log2(e) rounded to float grows with |x| (2^t's
    // relative error ~ ln2 * |t| * 2^-24, 4e-6 at x = -87): 2e-7 + 7e-8 |x|, as on avx2/avx512.
    Check c("exp16");
    Check same_formula("exp16 = x86 formula");
    for (int t = 0; t < trials; ++t) {
      float a[16], x[16], y[16];
      fill(a, 16, [&] { return t % 4 == 0 ? uniform(-100.f, -80.f) : t % 4 == 1 ? uniform(-1.f, 1.f) : uniform(-100.f, 10.f); });
      if (t == 0) a[0] = 0.f, a[1] = -0.f, a[2] = 1.f, a[3] = -87.f, a[4] = 10.f, a[5] = -100.f, a[6] = -1000.f, a[7] = -88.f;
      Neon::exp16(a, nullptr, x);
      Ref::exp16(a, nullptr, y);
      for (int i = 0; i < 16; ++i) {
        same_formula.expect(same(x[i], x86_exp(a[i])), "bits", x[i], x86_exp(a[i]), a[i]);
        if (a[i] < -87.f) {  // n held at -126: ~1e-38 (both x86 variants do the same), portable a subnormal or 0
          c.expect(x[i] >= 0 && x[i] < 2e-38f && y[i] < 2e-38f, "below -87", x[i], y[i], a[i]);
          continue;
        }
        const double rel = std::fabs(static_cast<double>(x[i]) - y[i]) / y[i];
        c.worst = std::max(c.worst, rel);
        c.expect(rel <= 2e-7 + 7e-8 * std::fabs(a[i]), "relative error", x[i], y[i], a[i]);
      }
    }
  }
}

void check_dots(int trials) {
  if (Neon::shift != Ref::shift) {
    Check c("ACTIVATION_SHIFT");
    c.expect(false, "value", Neon::shift, Ref::shift);
  }
  for (const bool q4 : {false, true}) {
    Check c(q4 ? "dot_q4/q4_float" : "dot_s8/acc_float");
    for (int t = 0; t < trials; ++t) {
      const int steps = 1 + static_cast<int>(rng() % 64);
      std::vector<uint8_t> w(64 * steps);
      std::vector<int32_t> x(2 * steps);
      for (auto& b : w) b = static_cast<uint8_t>(rng());
      for (auto& v : x) v = static_cast<int32_t>(bits32());
      if (t % 8 == 0) {  // extremes: every byte -128 or 127 / 0xFF, -128 activations
        for (auto& b : w) b = rng() % 2 ? 0x80 : 0x7F;
        if (q4) for (auto& b : w) b = 0xFF;
        for (auto& v : x) v = static_cast<int32_t>(0x80808080u);
      }
      int32_t a[16], b[16];
      float fa[16], fb[16];
      if (q4) {
        Neon::dot_q4(w.data(), x.data(), steps, a, fa);
        Ref::dot_q4(w.data(), x.data(), steps, b, fb);
      } else {
        Neon::dot_s8(reinterpret_cast<const int8_t*>(w.data()), x.data(), steps, a, fa);
        Ref::dot_s8(reinterpret_cast<const int8_t*>(w.data()), x.data(), steps, b, fb);
      }
      for (int i = 0; i < 16; ++i) {
        c.expect(a[i] == b[i], "sum", a[i], b[i], i);
        c.expect(same(fa[i], fb[i]), "as float", fa[i], fb[i], i);
      }
    }
  }
}

#if defined(__ARM_FEATURE_MATMUL_INT8)
// The neon_i8mm variant's row pairs (smmla over zipped columns: dot_pair, pair_rows) against the
// portable dot products of each row over the same weights: the same int32 sums, bit for bit.
void check_pairs(int trials) {
  namespace N = llmpool_neon;
  for (const bool q4 : {false, true}) {
    Check c(q4 ? "dot_pair (q4 rows)" : "dot_pair (int8 rows)");
    for (int t = 0; t < trials; ++t) {
      const int steps = 1 + static_cast<int>(rng() % 16);  // 8 inputs a step
      const int step_bytes = q4 ? 64 : 128;
      std::vector<uint8_t> w(step_bytes * steps);
      std::vector<int8_t> x(2 * 8 * steps);  // row 0's inputs, then row 1's
      for (auto& b : w) b = static_cast<uint8_t>(rng());
      for (auto& v : x) v = static_cast<int8_t>(rng());
      if (t % 8 == 0) {  // extremes, as in check_dots
        for (auto& b : w) b = q4 ? 0xFF : (rng() % 2 ? 0x80 : 0x7F);
        for (auto& v : x) v = -128;
      }
      N::PairAcc acc = N::pair_zero();
      for (int s = 0; s < steps; ++s) {
        const N::PairW pw = q4 ? N::load_pairw(w.data() + 64 * s) : N::load_pairw(reinterpret_cast<const int8_t*>(w.data()) + 128 * s);
        acc = N::dot_pair(acc, pw, x.data() + 8 * s, x.data() + 8 * steps + 8 * s);
      }
      N::Acc16 rows[2];
      N::pair_rows(acc, rows[0], rows[1]);
      for (int r = 0; r < 2; ++r) {
        std::vector<int32_t> words(2 * steps);
        std::memcpy(words.data(), x.data() + 8 * steps * r, 8 * steps);
        int32_t want[16], got[16];
        float fwant[16], fgot[16];
        if (q4) Ref::dot_q4(w.data(), words.data(), steps, want, fwant);
        else Ref::dot_s8(reinterpret_cast<const int8_t*>(w.data()), words.data(), 2 * steps, want, fwant);
        std::memcpy(got, &rows[r], 64);
        N::store16(fgot, N::acc_float(rows[r]));
        for (int i = 0; i < 16; ++i) {
          c.expect(got[i] == want[i], r ? "row 1 sum" : "row 0 sum", got[i], want[i], i);
          c.expect(same(fgot[i], fwant[i]), "as float", fgot[i], fwant[i], i);
        }
      }
    }
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 2000;
  const unsigned seed = argc > 2 ? static_cast<unsigned>(std::strtoul(argv[2], nullptr, 10)) : 1;
  rng.seed(seed);
  std::printf("isa_neon.h against isa_portable.h: %d trials per check, seed %u\n", trials, seed);
  check_loads(trials);
  check_float_ops(trials);
  check_dots(trials);
#if defined(__ARM_FEATURE_MATMUL_INT8)
  check_pairs(trials);
#endif
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
