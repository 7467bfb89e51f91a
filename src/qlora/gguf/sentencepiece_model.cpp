#include "qlora/gguf/sentencepiece_model.h"

#include <cstring>
#include <stdexcept>
#include <string_view>

#include "qlora/io/read_file.h"

namespace qlora::gguf {
namespace {

// A cursor over protobuf wire-format bytes.
class Wire {
 public:
  Wire(std::string_view bytes, const std::string& path, size_t base = 0) : b_(bytes), path_(path), base_(base) {}
  bool done() const { return at_ >= b_.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      need(1);
      const auto c = static_cast<uint8_t>(b_[at_++]);
      v |= static_cast<uint64_t>(c & 0x7f) << shift;
      if (!(c & 0x80)) return v;
    }
    fail("a varint longer than 10 bytes");
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    need(n);
    const std::string_view s = b_.substr(at_, n);
    at_ += n;
    return s;
  }
  float fixed32() {
    need(4);
    float f;
    std::memcpy(&f, b_.data() + at_, 4);
    at_ += 4;
    return f;
  }
  void skip(uint32_t wire_type) {
    switch (wire_type) {
      case 0: varint(); return;
      case 1: need(8); at_ += 8; return;
      case 2: bytes(); return;
      case 5: need(4); at_ += 4; return;
      default: fail("wire type " + std::to_string(wire_type));
    }
  }
  size_t offset() const { return base_ + at_; }
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(path_ + ": not a sentencepiece model (" + what + " at byte " +
                                std::to_string(offset()) + ")");
  }

 private:
  void need(uint64_t n) const {
    if (n > b_.size() - at_) fail("a field past the end");
  }
  std::string_view b_;
  const std::string& path_;
  size_t base_, at_ = 0;
};

SentencePiece read_piece(Wire w) {
  SentencePiece p;
  while (!w.done()) {
    const uint64_t key = w.varint();
    const uint64_t field = key >> 3;
    const auto wire = static_cast<uint32_t>(key & 7);
    if (field == 1 && wire == 2) p.piece = std::string(w.bytes());
    else if (field == 2 && wire == 5) p.score = w.fixed32();
    else if (field == 3 && wire == 0) p.type = static_cast<int32_t>(w.varint());
    else w.skip(wire);
  }
  return p;
}

}  // namespace

SentencePieceModel read_sentencepiece_model(const std::string& path) {
  const auto text = io::read_file(path);
  if (!text) throw std::invalid_argument(path + ": cannot read");
  SentencePieceModel m;
  Wire w(*text, path);
  while (!w.done()) {
    const size_t start = w.offset();
    const uint64_t key = w.varint();
    const uint64_t field = key >> 3;
    const auto wire = static_cast<uint32_t>(key & 7);
    if (field == 1 && wire == 2) {
      m.pieces.push_back(read_piece(Wire(w.bytes(), path, start)));
    } else if (field == 3 && wire == 2) {  // NormalizerSpec
      Wire n(w.bytes(), path, start);
      while (!n.done()) {
        const uint64_t k = n.varint();
        if ((k >> 3) == 3 && (k & 7) == 0) m.add_dummy_prefix = n.varint() != 0;
        else n.skip(static_cast<uint32_t>(k & 7));
      }
    } else {
      w.skip(wire);
    }
  }
  if (m.pieces.empty()) w.fail("no pieces");
  return m;
}

}  // namespace qlora::gguf
