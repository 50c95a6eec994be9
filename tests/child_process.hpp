#pragma once

// A helper process of a test (tests/worker_host.cpp, tests/node_host.cpp): started with
// arguments, it prints the port it listens on as its first line and runs until its stdin
// closes; the test may also signal or kill it.

#include <doctest/doctest.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace troupe::testing {

class child_process {
public:
  explicit child_process(const std::string& path, std::vector<std::string> args = {}) {
    int in[2];
    int out[2];
    REQUIRE(pipe(in) == 0);
    REQUIRE(pipe(out) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_addclose(&actions, in[1]);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    args.insert(args.begin(), path);
    std::vector<char*> argv;
    for (auto& a : args)
      argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    REQUIRE(posix_spawn(&pid_, path.c_str(), &actions, nullptr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    auto stream = fdopen(out[0], "r");
    REQUIRE(stream != nullptr);
    unsigned port = 0;
    REQUIRE(fscanf(stream, "%u", &port) == 1);
    fclose(stream);
    port_ = static_cast<uint16_t>(port);
  }

  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  ~child_process() {
    if (stdin_ >= 0)
      close(stdin_); // asks the process to end
    if (pid_ > 0) {
      kill(pid_, SIGCONT);
      kill_now();
    }
  }

  void signal(int sig) {
    kill(pid_, sig);
  }

  void kill_now() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  /// Waits for the process to end on its own; its exit status, or -1 after a signal.
  int wait_exit() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  /// The exit status once the process ends on its own within `limit` (-1 after a signal);
  /// nullopt while it still runs.
  std::optional<int> exit_within(std::chrono::milliseconds limit) {
    auto until = std::chrono::steady_clock::now() + limit;
    for (;;) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      if (std::chrono::steady_clock::now() >= until)
        return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  pid_t pid() const {
    return pid_;
  }

  uint16_t port() const {
    return port_;
  }

private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  uint16_t port_ = 0;
};

} // namespace troupe::testing
