// Durable writes, one way (DESIGN.md: "write aside, fsync, rename"): a file is written aside at
// path + ".tmp", fsynced, renamed over path, and path's directory fsynced, so a crash or a power
// loss leaves either the old file or the new one at path, never a torn one. Small files go through
// write_file_atomic(); writers that stream a large file aside themselves (safetensors, GGUF) write
// to aside_path(), close it, and finish with commit_aside(). Every error names the file.
#pragma once

#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace qlora::io {

struct DurableFileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Where a durable write of `path` goes first: path + ".tmp".
std::string aside_path(const std::string& path);

// Creates (truncating) aside_path(path) for writing; returns its descriptor.
int open_aside(const std::string& path);

// Writes all of `nbytes` to fd (retrying short writes and EINTR); `path` names the file in errors.
void write_all(int fd, const void* data, size_t nbytes, const std::string& path);

// The commit of a file written aside and already closed: fsyncs `tmp`, renames it over `path`,
// fsyncs path's directory. When anything before the rename fails, tmp is removed and path keeps
// its old contents. Throws DurableFileError naming path.
void commit_aside(const std::string& tmp, const std::string& path);

// Writes `contents` aside and commits it over path.
void write_file_atomic(const std::string& path, std::string_view contents);

// fsync of a file, or of a directory so that the creations and renames in it survive a power loss.
void fsync_path(const std::string& path);
// fsync of the directory holding `path` (its rename or creation is durable after it).
void fsync_parent(const std::string& path);

// The seam through which tests make an fsync fail (a disk error, a full disk), as train/faults.h is
// for a training run: production never installs one. fsync_errno(path) returns the errno with
// which fsync of path fails, 0 to let it run.
struct DurableFaults {
  std::function<int(const std::string& path)> fsync_errno;
};
void install_durable_faults(DurableFaults faults);  // tests only; {} removes them

}  // namespace qlora::io
