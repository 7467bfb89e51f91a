// The flat buffer of one shard group: members of any dtype laid out back to back in one 1-D
// buffer, padded so it splits into `shards` equal pieces. One collective then moves a whole group
// (all-gather of a layer's NF4 bytes, reduce-scatter of its LoRA gradients), whatever the shapes.
//
// A byte buffer (kByte) holds members of any dtype, each starting at a multiple of kAlign bytes so
// that typed views (int8 scalers, bf16 factors, fp32 norms) are aligned. A float buffer (kFloat,
// ...) holds members of its own dtype only, packed tight (the trainable fp32 adapters: their
// gradients are summed element-wise by reduce-scatter, so the buffer must be typed).
//
// Padding goes at the end. A member may straddle shard boundaries: shards
// are cut by position, not by member, which is what makes every world size work for every shape.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace qlora::engine {

struct FlatMember {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in buffer elements
  int64_t units = 0;   // buffer elements the member occupies (bytes for a byte buffer)
  int64_t numel() const;
};

class FlatLayout {
 public:
  static constexpr int64_t kAlign = 16;  // bytes; the largest member element is 8 bytes

  FlatLayout(at::ScalarType buffer_dtype, int64_t shards);

  // Appends a member; returns its index. Throws if `dtype` cannot live in this buffer or the name
  // is taken.
  size_t add(const std::string& name, at::ScalarType dtype, std::vector<int64_t> shape);

  at::ScalarType buffer_dtype() const { return buffer_dtype_; }
  int64_t shards() const { return shards_; }
  const std::vector<FlatMember>& members() const { return members_; }
  const FlatMember& member(const std::string& name) const;  // throws naming it when absent
  int64_t used() const { return used_; }                     // elements before padding
  // Total elements, a multiple of shards() (and of kAlign bytes per shard, so each rank's shard of
  // a byte buffer starts aligned too).
  int64_t padded_numel() const;
  int64_t shard_numel() const { return padded_numel() / shards_; }

  // A new zero-filled full buffer; `options` give the device (the dtype is the buffer's).
  at::Tensor empty_full(const at::TensorOptions& options) const;
  // The typed view of member `m` inside `full` ([padded_numel()] of the buffer dtype): writes to
  // it write the buffer.
  at::Tensor view(const at::Tensor& full, const FlatMember& m) const;
  // Copies `value` (same numel; cast to the member dtype) into its place in `full`.
  void pack(at::Tensor& full, const std::string& name, const at::Tensor& value) const;
  // Rank `r`'s shard of a full buffer (a view).
  at::Tensor shard_of(const at::Tensor& full, int64_t r) const;

 private:
  at::ScalarType buffer_dtype_;
  int64_t shards_;
  int64_t used_ = 0;
  std::vector<FlatMember> members_;
};

}  // namespace qlora::engine
