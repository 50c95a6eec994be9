#include "kernels/cuda/check.hpp"

#include "troupe/errors.hpp"

#include <string>

namespace troupe::cuda {

void fail(const char* domain, int code, const char* what, bool out_of_memory, const char* call,
          const char* file, int line) {
  int device = -1;
  cudaGetDevice(&device);
  auto message = std::string{domain} + " error " + std::to_string(code) +
                 (what && *what ? std::string{" ("} + what + ")" : std::string{}) + " in " + call +
                 " at " + file + ":" + std::to_string(line) + " on cuda:" + std::to_string(device);
  throw error{out_of_memory ? errc::memory_error : errc::worker_error, message};
}

} // namespace troupe::cuda
