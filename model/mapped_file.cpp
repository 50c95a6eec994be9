#include "model/mapped_file.hpp"

#include "troupe/errors.hpp"
#include "kernels/host_pages.hpp"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace troupe {

namespace {

/// An open descriptor of the regular file at `path` and its size (and what it is, for
/// `identity`); throws naming the file, prefixed with `kind`. Non-blocking, so that a FIFO
/// or a device is refused instead of waiting forever.
int open_regular(const std::string& path, const char* kind, std::size_t& size,
                 std::string* identity = nullptr) {
  auto fail = [&](const std::string& what) {
    throw error{errc::invalid_argument, std::string{kind} + " '" + path + "': " + what};
  };
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    fail(std::strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    auto err = errno;
    ::close(fd);
    fail(std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("not a regular file");
  }
  size = static_cast<std::size_t>(st.st_size);
  if (identity != nullptr) {
    std::error_code ec;
    auto absolute = std::filesystem::absolute(path, ec);
    *identity = (ec ? path : absolute.lexically_normal().string()) + " size " +
                std::to_string(st.st_size) + " device " + std::to_string(st.st_dev) + " inode " +
                std::to_string(st.st_ino) + " modified " + std::to_string(st.st_mtim.tv_sec) + "." +
                std::to_string(st.st_mtim.tv_nsec);
  }
  return fd;
}

} // namespace

mapped_file::mapped_file(const std::string& path, const char* kind, std::size_t min_size) {
  auto fail = [&](const std::string& what) {
    throw error{errc::invalid_argument, std::string{kind} + " '" + path + "': " + what};
  };
  fd_ = open_regular(path, kind, size_, &identity_);
  if (size_ < min_size) {
    ::close(fd_);
    fail("only " + std::to_string(size_) + " bytes, too short for a header");
  }
  map_ = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
  if (map_ == MAP_FAILED) {
    auto err = errno;
    ::close(fd_);
    map_ = nullptr;
    fail(std::string{"mmap failed: "} + std::strerror(err));
  }
}

std::string read_small_file(const std::string& path, const char* kind, std::size_t max_bytes) {
  std::size_t size = 0;
  int fd = open_regular(path, kind, size);
  auto fail = [&](const std::string& what) {
    ::close(fd);
    throw error{errc::invalid_argument, std::string{kind} + " '" + path + "': " + what};
  };
  if (size > max_bytes)
    fail(std::to_string(size) + " bytes, more than the " + std::to_string(max_bytes) +
         " such a file may have");
  std::string text(size, '\0');
  std::size_t got = 0;
  while (got < size) {
    auto n = ::read(fd, text.data() + got, size - got);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      fail(std::strerror(errno));
    if (n == 0)
      break; // it shrank meanwhile: what is there
    got += static_cast<std::size_t>(n);
  }
  text.resize(got);
  ::close(fd);
  return text;
}

bool mapped_file::contains(const void* p) const {
  auto at = static_cast<const std::byte*>(p);
  return map_ != nullptr && at >= data() && at < data() + size_;
}

void mapped_file::release(const void* p, std::size_t bytes) const {
  const auto page = static_cast<uintptr_t>(host_page_size());
  auto begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  auto end = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  // Advice only: a failure leaves the pages resident, which is what happened before.
  if (end > begin)
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

mapped_file::~mapped_file() {
  munmap(map_, size_);
  ::close(fd_);
}

} // namespace troupe
