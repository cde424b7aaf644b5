// A grammar's packed bitmask laid over the logits of the rows that sample under it, in place:
// a logit whose token the grammar does not allow becomes -inf.
//
// The engine sends one int32 row per constrained request (bit i of word i / 32 set: token i
// allowed; workers/grammar_mask.py). In torch that was an unpack to one bool per token, a
// logical_not and a masked_fill over the whole [rows, vocab] float32 block: 6 ms a step at 64
// rows of SmolLM2's 49k vocabulary on the development machine (2-core Zen 4). Here each word is
// read once: all set (free text) skips its 32 logits, and the rest store -inf through the
// word's own bits as the store mask. Columns past the bitmask are never allowed.
//
// One thread: the pass is a memory stream of a few MB, and a parallel region would wait for a
// thread that a served engine's other processes have preempted.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr uint32_t ALL_ALLOWED = 0xFFFFFFFFu;

void mask_row(float* out, const uint32_t* words, int64_t num_words, int64_t vocab) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min(vocab, num_words * 32);
  int64_t col = 0;
  for (int64_t w = 0; col < covered; ++w, col += 32) {
    const uint32_t word = words[w];
    if (word == ALL_ALLOWED) continue;
    const int64_t end = std::min(col + 32, covered);
#if defined(__AVX512F__)
    if (end - col == 32) {
      const __m512 fill = _mm512_set1_ps(neg_inf);
      _mm512_mask_storeu_ps(out + col, static_cast<__mmask16>(~word & 0xFFFFu), fill);
      _mm512_mask_storeu_ps(out + col + 16, static_cast<__mmask16>(~word >> 16), fill);
      continue;
    }
#endif
    for (int64_t c = col; c < end; ++c) {
      if (!((word >> (c - col)) & 1u)) out[c] = neg_inf;
    }
  }
  std::fill(out + covered, out + vocab, neg_inf);
}

// logits: [batch, vocab] float32; rows: [n] int64 (batch rows); bitmask: [n, words] int32.
void grammar_mask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be a 1-d int64 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous 2-d int32 tensor");
  TORCH_CHECK(bitmask.size(0) == rows.size(0), "one bitmask row per constrained row");
  const int64_t batch = logits.size(0), vocab = logits.size(1), num_words = bitmask.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {  // checked before anything is written
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < batch, "row ", row_ids[i], " is outside the batch of ", batch);
  }
  const auto* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* base = logits.data_ptr<float>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    mask_row(base + row_ids[i] * vocab, words + i * num_words, num_words, vocab);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("grammar_mask(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()"); }

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("grammar_mask", &grammar_mask); }
