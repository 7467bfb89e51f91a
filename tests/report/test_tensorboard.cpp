// TensorBoard's framing checksum: CRC-32C against the published check values (RFC 3720's test
// patterns and the "123456789" check value every CRC catalogue lists). The event files themselves
// are read back by the tensorboard package in tests/recipes/test_tensorboard.py.
#include <gtest/gtest.h>

#include <string>

#include "qlora/report/tensorboard.h"

using qlora::report::crc32c;

TEST(TensorBoard, Crc32cMatchesPublishedCheckValues) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xe3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8a9136aau);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62a8ab43u);
  std::string inc;
  for (int i = 0; i < 32; ++i) inc += static_cast<char>(i);
  EXPECT_EQ(crc32c(inc.data(), inc.size()), 0x46dd794eu);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}
