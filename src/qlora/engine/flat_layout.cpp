#include "qlora/engine/flat_layout.h"

#include <ATen/ATen.h>

#include <numeric>
#include <stdexcept>

namespace qlora::engine {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

int64_t FlatMember::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

FlatLayout::FlatLayout(at::ScalarType buffer_dtype, int64_t shards) : buffer_dtype_(buffer_dtype), shards_(shards) {
  if (shards < 1) throw std::invalid_argument("FlatLayout: shards must be >= 1, got " + std::to_string(shards));
}

size_t FlatLayout::add(const std::string& name, at::ScalarType dtype, std::vector<int64_t> shape) {
  for (const auto& m : members_)
    if (m.name == name) throw std::invalid_argument("FlatLayout: member '" + name + "' added twice");
  FlatMember m{name, dtype, std::move(shape), 0, 0};
  for (int64_t d : m.shape)
    if (d < 0) throw std::invalid_argument("FlatLayout: member '" + name + "' has a negative dim");
  if (buffer_dtype_ == at::kByte) {
    m.offset = round_up(used_, kAlign);
    m.units = m.numel() * static_cast<int64_t>(c10::elementSize(dtype));
  } else {
    if (dtype != buffer_dtype_)
      throw std::invalid_argument("FlatLayout: member '" + name + "' is " + std::string(c10::toString(dtype)) +
                                  " but the buffer is " + c10::toString(buffer_dtype_));
    m.offset = used_;
    m.units = m.numel();
  }
  used_ = m.offset + m.units;
  members_.push_back(std::move(m));
  return members_.size() - 1;
}

const FlatMember& FlatLayout::member(const std::string& name) const {
  for (const auto& m : members_)
    if (m.name == name) return m;
  throw std::out_of_range("FlatLayout: no member '" + name + "'");
}

int64_t FlatLayout::padded_numel() const {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(buffer_dtype_));
  const int64_t per_shard_align = std::max<int64_t>(1, kAlign / elem);
  return round_up(std::max<int64_t>(used_, 1), shards_ * per_shard_align);
}

at::Tensor FlatLayout::empty_full(const at::TensorOptions& options) const {
  return at::zeros({padded_numel()}, options.dtype(buffer_dtype_));
}

at::Tensor FlatLayout::view(const at::Tensor& full, const FlatMember& m) const {
  at::Tensor slice = full.narrow(0, m.offset, m.units);
  if (buffer_dtype_ == at::kByte && m.dtype != at::kByte) slice = slice.view(m.dtype);
  return slice.view(m.shape);
}

void FlatLayout::pack(at::Tensor& full, const std::string& name, const at::Tensor& value) const {
  const FlatMember& m = member(name);
  if (value.numel() != m.numel())
    throw std::invalid_argument("FlatLayout::pack: '" + name + "' has " + std::to_string(value.numel()) +
                                " elements, the layout " + std::to_string(m.numel()));
  view(full, m).copy_(value.reshape(m.shape));
}

at::Tensor FlatLayout::shard_of(const at::Tensor& full, int64_t r) const {
  return full.narrow(0, r * shard_numel(), shard_numel());
}

}  // namespace qlora::engine
