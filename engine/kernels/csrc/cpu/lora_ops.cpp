// Multi-LoRA delta of one projection for the CPU, in one call: each row that uses an adapter gets
// y[row] += ((x[row] @ A[slot]) * scale) @ B[slot], per output slice, read straight from the stacked slot weights.
// PyTorch's way (gather rows, pad segments, a batched shrink, scale, a batched expand per slice, gather back, add) is
// about a dozen ops a projection, and bmm on such thin shapes runs far below the arithmetic's cost: the delta is a few
// percent of the projection's flops, so its dispatch and padding were most of what LoRA added to a step.
//
// Each row's sums run in one fixed order whatever else is in the batch (over the input for the shrink, over the rank
// for the expand, then one add into y), so a row's result does not depend on its neighbours or on the threads.

// Only the headers used, not <torch/extension.h> (all of torch's C++ API): a build parses a fraction of the headers.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kChunkRows = 16;  // rows of one slot handled together: A and B are read once per chunk
constexpr int64_t kShrinkRows = 4;  // rows a shrink tile holds: one load of A feeds this many multiply-adds
constexpr int64_t kShrinkCols = 16;
constexpr int64_t kExpandRows = 4;
constexpr int64_t kExpandCols = 64;

// Tiles whose sizes are constants, so their accumulators stay in registers. out[r][c] (+)= sum over k in order of
// in[r][k] * w[k][c]; every element's sum runs in the same order whichever tile (or the scalar tail) computes it.
template <int R, int C>
inline void tile(const float* const* in, const float* w, int64_t depth, int64_t w_stride, float* const* out,
                 bool add) {
  float acc[R][C] = {};
  for (int64_t k = 0; k < depth; ++k) {
    const float* wk = w + k * w_stride;
    for (int r = 0; r < R; ++r) {
      const float v = in[r][k];
      for (int c = 0; c < C; ++c) acc[r][c] += v * wk[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = add ? out[r][c] + acc[r][c] : acc[r][c];
}

inline void tail(const float* const* in, int64_t rows, const float* w, int64_t depth, int64_t w_stride,
                 float* const* out, int64_t cols, bool add) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < depth; ++k) acc += in[r][k] * w[k * w_stride + c];
      out[r][c] = add ? out[r][c] + acc : acc;
    }
}

// out[r][0:cols] (+)= in[r][0:depth] @ w [depth, cols] (row stride w_stride), for `rows` rows.
template <int R, int C>
void matmul_rows(const float* const* in, int64_t rows, const float* w, int64_t depth, int64_t w_stride,
                 float* const* out, int64_t cols, bool add) {
  const float* in_r[R];
  float* out_r[R];
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int64_t n = std::min<int64_t>(R, rows - r0);
    int64_t c0 = 0;
    for (; c0 + C <= cols; c0 += C) {
      for (int64_t r = 0; r < n; ++r) {
        in_r[r] = in[r0 + r];
        out_r[r] = out[r0 + r] + c0;
      }
      switch (n) {  // a tile per row count: the last rows of a chunk keep their accumulators in registers too
#define ORCINUS_TILE(k) \
  case k:               \
    if constexpr (k <= R) tile<k, C>(in_r, w + c0, depth, w_stride, out_r, add); \
    break;
        ORCINUS_TILE(1) ORCINUS_TILE(2) ORCINUS_TILE(3) ORCINUS_TILE(4)
        ORCINUS_TILE(5) ORCINUS_TILE(6) ORCINUS_TILE(7) ORCINUS_TILE(8)
#undef ORCINUS_TILE
      }
    }
    if (c0 < cols) {
      for (int64_t r = 0; r < n; ++r) {
        in_r[r] = in[r0 + r];
        out_r[r] = out[r0 + r] + c0;
      }
      tail(in_r, n, w + c0, depth, w_stride, out_r, cols - c0, add);
    }
  }
}

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              ": a contiguous float32 CPU tensor");
}

// x [N, in], y [N, out] (updated in place, row stride y_stride); a [slots, in, S*r]; b[i] [slots, r, sizes[i]] at
// column offsets[i] of y. rows [M]: the adapter rows grouped by slot, segment s being rows[starts[s]:starts[s+1]] of
// slot slots[s]; scale [M] each one's adapter's scale. Rows not listed are left as they are.
void lora_add(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const std::vector<at::Tensor>& b,
              const std::vector<int64_t>& offsets, const at::Tensor& rows, const at::Tensor& starts,
              const at::Tensor& slots, const at::Tensor& scale) {
  check_f32(x, "x");
  check_f32(a, "a");
  check_f32(scale, "scale");
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == at::kFloat && y.dim() == 2 && y.stride(1) == 1,
              "y: a float32 [N, out] CPU tensor with unit column stride");
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && x.size(1) == a.size(1) && y.size(0) == x.size(0), "x, a, y: shapes");
  TORCH_CHECK(b.size() == offsets.size() && !b.empty(), "b and offsets: one per slice");
  for (const auto& t : {rows, starts, slots})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(),
                "rows, starts, slots: contiguous int64 CPU tensors");
  const int64_t in = a.size(1), width = a.size(2), num_slices = static_cast<int64_t>(b.size());
  const int64_t rank = width / num_slices, n = x.size(0), segments = slots.size(0);
  TORCH_CHECK(rank * num_slices == width && starts.size(0) == segments + 1 && scale.size(0) == rows.size(0),
              "a's width, starts, scale: shapes");
  std::vector<const float*> bp(num_slices);
  std::vector<int64_t> sizes(num_slices);
  for (int64_t i = 0; i < num_slices; ++i) {
    check_f32(b[i], "b");
    TORCH_CHECK(b[i].dim() == 3 && b[i].size(0) == a.size(0) && b[i].size(1) == rank &&
                offsets[i] >= 0 && offsets[i] + b[i].size(2) <= y.size(1), "b: [slots, rank, size] within y");
    bp[i] = b[i].data_ptr<float>();
    sizes[i] = b[i].size(2);
  }
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* sc = scale.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ys = y.stride(0);
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(row[i] >= 0 && row[i] < n, "rows: out of range");
  for (int64_t s = 0; s < segments; ++s)
    TORCH_CHECK(slot[s] >= 0 && slot[s] < a.size(0) && start[s] <= start[s + 1] && start[s] >= 0 &&
                start[s + 1] <= rows.size(0), "starts, slots: out of range");

  // Work items: each segment cut into chunks of at most kChunkRows rows; every item writes its own rows of y.
  std::vector<int64_t> item_begin, item_segment;
  for (int64_t s = 0; s < segments; ++s)
    for (int64_t r = start[s]; r < start[s + 1]; r += kChunkRows) {
      item_begin.push_back(r);
      item_segment.push_back(s);
    }
  const int64_t items = static_cast<int64_t>(item_begin.size());
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xa(kChunkRows * width);
    const float* x_r[kChunkRows];
    const float* xa_r[kChunkRows];
    float* xa_w[kChunkRows];
    float* y_r[kChunkRows];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t s = item_segment[it], first = item_begin[it];
      const int64_t count = std::min(kChunkRows, start[s + 1] - first);
      for (int64_t j = 0; j < count; ++j) {
        x_r[j] = xp + row[first + j] * in;
        xa_r[j] = xa_w[j] = xa.data() + j * width;
      }
      // Shrink: each row's x @ A[slot] summed in input order, then scaled.
      // A tile as wide as A where it fits in registers, so A streams through once, in order.
      const float* as = ap + slot[s] * in * width;
      switch (width) {
        case 32: matmul_rows<kShrinkRows, 32>(x_r, count, as, in, width, xa_w, width, false); break;
        case 48: matmul_rows<kShrinkRows, 48>(x_r, count, as, in, width, xa_w, width, false); break;
        case 64: matmul_rows<kShrinkRows, 64>(x_r, count, as, in, width, xa_w, width, false); break;
        default: matmul_rows<kShrinkRows, kShrinkCols>(x_r, count, as, in, width, xa_w, width, false);
      }
      for (int64_t j = 0; j < count; ++j) {
        const float f = sc[first + j];
        for (int64_t c = 0; c < width; ++c) xa_w[j][c] *= f;
      }
      // Expand: per slice, each row's delta summed over the rank, then added to y once.
      for (int64_t i = 0; i < num_slices; ++i) {
        for (int64_t j = 0; j < count; ++j) {
          xa_r[j] = xa.data() + j * width + i * rank;
          y_r[j] = yp + row[first + j] * ys + offsets[i];
        }
        matmul_rows<kExpandRows, kExpandCols>(xa_r, count, bp[i] + slot[s] * rank * sizes[i], rank, sizes[i], y_r,
                                              sizes[i], true);
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_add", &lora_add, "y[row] += (x[row] @ A[slot] * scale) @ B[slot] per slice, rows grouped by slot (CPU)");
}
