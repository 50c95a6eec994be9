#include "model/weight_cache.hpp"

#include "kernels/log.hpp"
#include "kernels/host_pages.hpp"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace troupe {

namespace {

/// Bumped whenever the bytes a layout description stands for change (a packed format).
constexpr const char* format_line = "troupe weights 2\n";

std::string file_name(const weight_cache_key& key) {
  uint64_t hash = 14695981039346656037ull; // FNV-1a
  for (auto* part : {&key.model, &key.layout})
    for (unsigned char c : *part + '\n') {
      hash ^= c;
      hash *= 1099511628211ull;
    }
  char name[32];
  std::snprintf(name, sizeof name, "%016llx.weights", static_cast<unsigned long long>(hash));
  return name;
}

/// Where the weights start: at 2 MiB, so that the page cache's huge folios of the file fall
/// on whole huge pages of the weights.
std::size_t data_offset_after(std::size_t header_bytes) {
  constexpr std::size_t huge = std::size_t{2} << 20;
  return (header_bytes + huge - 1) / huge * huge;
}

/// Bytes at the end of the header that hold the checkpoint's content hash, written last.
constexpr std::size_t hash_bytes = sizeof(uint64_t);

/// The header: what the weights were made from and how, padded to whole pages; its last
/// `hash_bytes` hold the content hash (zero here).
std::string header(const weight_cache_key& key, std::size_t bytes) {
  auto text = std::string{format_line} + "bytes " + std::to_string(bytes) + "\n" + key.files +
              "\n" + key.layout + "\n";
  auto page = host_page_size();
  text.resize(((text.size() + hash_bytes) / page + 1) * page, '\0');
  return text;
}

void warn(const std::string& what) {
  get_logger("troupe.worker")->warn("weight cache: {}", what);
}

bool read_all(int fd, char* out, std::size_t bytes, off_t at) {
  while (bytes > 0) {
    auto n = pread(fd, out, bytes, at);
    if (n <= 0)
      return false;
    out += n;
    bytes -= static_cast<std::size_t>(n);
    at += n;
  }
  return true;
}

bool write_all(int fd, const char* in, std::size_t bytes, off_t at) {
  while (bytes > 0) {
    auto n = pwrite(fd, in, bytes, at);
    if (n <= 0)
      return false;
    in += n;
    bytes -= static_cast<std::size_t>(n);
    at += n;
  }
  return true;
}

} // namespace

weight_cache_file::weight_cache_file(int fd, std::string path, std::size_t data_offset)
  : fd_(fd), path_(std::move(path)), data_offset_(data_offset) {}

weight_cache_file::weight_cache_file(weight_cache_file&& other) noexcept
  : fd_(other.fd_), path_(std::move(other.path_)), data_offset_(other.data_offset_),
    hash_at_(other.hash_at_), content_hash_(other.content_hash_) {
  other.fd_ = -1;
}

weight_cache_file& weight_cache_file::operator=(weight_cache_file&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0)
      ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    data_offset_ = other.data_offset_;
    hash_at_ = other.hash_at_;
    content_hash_ = other.content_hash_;
    other.fd_ = -1;
  }
  return *this;
}

weight_cache_file::~weight_cache_file() {
  if (fd_ >= 0)
    ::close(fd_);
}

std::optional<weight_cache_file> weight_cache_file::find(const std::string& directory,
                                                         const weight_cache_key& key,
                                                         std::size_t bytes) {
  auto path = (std::filesystem::path{directory} / file_name(key)).string();
  // Non-blocking: a FIFO put in its place is refused, not waited on.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return std::nullopt;
  weight_cache_file file{fd, path, 0};
  struct stat st;
  auto expected = header(key, bytes);
  auto offset = data_offset_after(expected.size());
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<std::size_t>(st.st_size) < offset + bytes)
    return std::nullopt;
  std::string found(expected.size(), '\0');
  auto described = expected.size() - hash_bytes;
  if (!read_all(fd, found.data(), found.size(), 0) ||
      found.compare(0, described, expected, 0, described) != 0)
    return std::nullopt;
  std::memcpy(&file.content_hash_, found.data() + described, hash_bytes);
  file.data_offset_ = offset;
  return file;
}

std::optional<weight_cache_file> weight_cache_file::create(const std::string& directory,
                                                           const weight_cache_key& key,
                                                           std::size_t bytes) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) {
    warn("cannot make '" + directory + "': " + ec.message());
    return std::nullopt;
  }
  // Unnamed until it is whole, so that a process that dies while packing leaves nothing.
  int fd = ::open(directory.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);
  if (fd < 0) {
    warn("cannot make a file in '" + directory + "': " + std::strerror(errno));
    return std::nullopt;
  }
  auto path = (std::filesystem::path{directory} / file_name(key)).string();
  auto head = header(key, bytes);
  weight_cache_file file{fd, path, data_offset_after(head.size())};
  file.hash_at_ = head.size() - hash_bytes;
  // The blocks are taken now: a full disk under a mapping would kill the process (SIGBUS)
  // at the first write that finds no room.
  auto total = file.data_offset_ + round_to_host_pages(bytes);
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(total)); err != 0) {
    warn("no room for " + std::to_string(total >> 20) + " MiB in '" + directory +
         "': " + std::strerror(err));
    return std::nullopt;
  }
  if (!write_all(fd, head.data(), head.size(), 0)) {
    warn("cannot write '" + path + "': " + std::strerror(errno));
    return std::nullopt;
  }
  return file;
}

bool weight_cache_file::commit(uint64_t content_hash) {
  if (!write_all(fd_, reinterpret_cast<const char*>(&content_hash), hash_bytes,
                 static_cast<off_t>(hash_at_))) {
    warn("cannot write '" + path_ + "': " + std::strerror(errno));
    return false;
  }
  // An unnamed file is linked through its /proc entry (linkat with AT_EMPTY_PATH needs a
  // privilege), under a name of its own, then renamed over the old one in one step.
  auto proc = "/proc/self/fd/" + std::to_string(fd_);
  auto part = path_ + "." + std::to_string(getpid()) + ".part";
  if (linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, part.c_str(), AT_SYMLINK_FOLLOW) != 0) {
    warn("cannot name '" + part + "': " + std::strerror(errno));
    return false;
  }
  if (std::rename(part.c_str(), path_.c_str()) != 0) {
    warn("cannot rename '" + part + "': " + std::strerror(errno));
    ::unlink(part.c_str());
    return false;
  }
  return true;
}

std::string default_weight_cache() {
  if (auto set = std::getenv("TROUPE_WEIGHT_CACHE"))
    return std::string{set} == "off" ? std::string{} : std::string{set};
  if (auto xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0')
    return std::string{xdg} + "/troupe/weights";
  if (auto home = std::getenv("HOME"); home != nullptr && *home != '\0')
    return std::string{home} + "/.cache/troupe/weights";
  return {};
}

} // namespace troupe
