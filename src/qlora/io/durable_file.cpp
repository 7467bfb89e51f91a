#include "qlora/io/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace qlora::io {
namespace {

DurableFaults& faults() {
  static DurableFaults f;
  return f;
}

std::string error_text(int err) { return std::strerror(err); }

// Removes tmp and rethrows: what a failed commit leaves is the old file at path and nothing else.
[[noreturn]] void fail_commit(const std::string& tmp, const std::string& path, const std::string& what) {
  ::unlink(tmp.c_str());
  throw DurableFileError("cannot commit '" + path + "': " + what);
}

}  // namespace

std::string aside_path(const std::string& path) { return path + ".tmp"; }

int open_aside(const std::string& path) {
  const std::string tmp = aside_path(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw DurableFileError("cannot create '" + tmp + "': " + error_text(errno));
  return fd;
}

void write_all(int fd, const void* data, size_t nbytes, const std::string& path) {
  auto* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    const ssize_t n = ::write(fd, p, nbytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw DurableFileError("write to '" + path + "' failed: " + error_text(errno));
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DurableFileError("cannot open '" + path + "' to fsync it: " + error_text(errno));
  const int injected = faults().fsync_errno ? faults().fsync_errno(path) : 0;
  const int rc = injected ? -1 : ::fsync(fd);
  const int err = injected ? injected : errno;
  ::close(fd);
  if (rc != 0) throw DurableFileError("fsync of '" + path + "' failed: " + error_text(err));
}

void fsync_parent(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  fsync_path(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash));
}

void commit_aside(const std::string& tmp, const std::string& path) {
  try {
    fsync_path(tmp);
  } catch (const DurableFileError& e) {
    fail_commit(tmp, path, e.what());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    fail_commit(tmp, path, "rename from '" + tmp + "' failed: " + error_text(errno));
  // Without the directory fsync the rename itself may not survive a power loss.
  fsync_parent(path);
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  const std::string tmp = aside_path(path);
  const int fd = open_aside(path);
  try {
    write_all(fd, contents.data(), contents.size(), tmp);
  } catch (const DurableFileError& e) {
    ::close(fd);
    fail_commit(tmp, path, e.what());
  }
  // close() is where some filesystems (NFS) report a failed write-back.
  if (::close(fd) != 0) fail_commit(tmp, path, "close of '" + tmp + "' failed: " + error_text(errno));
  commit_aside(tmp, path);
}

void install_durable_faults(DurableFaults f) { faults() = std::move(f); }

}  // namespace qlora::io
