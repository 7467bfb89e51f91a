// A .safetensors file from untrusted bytes: the header (length, JSON, dtypes, shapes, offsets)
// is parsed and bounded, then every tensor's bytes are read through the mapping as a tensor.
#include <cstdint>
#include <exception>

#include "qlora/io/safetensors.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = qlora::fuzz::input_file(data, size, "model.safetensors");
  try {
    const auto f = qlora::io::SafetensorsFile::open(path);
    double sum = 0;
    for (const auto& t : f.tensors()) {
      const at::Tensor x = f.tensor(t.name);
      if (x.numel() > 0) sum += x.reshape({-1})[0].item<double>() * 0;  // touches the first element
    }
    (void)sum;
  } catch (const std::exception&) {
  }
  return 0;
}
