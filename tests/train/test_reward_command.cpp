// grpo.reward_command (train/reward_command.h, io/subprocess.h): small programs written here score
// completions; every way such a program fails is an error naming the command and what went wrong,
// and none of them hangs the caller (a deadline kills the program's whole process group; stdin and
// stdout are pumped together, so a program that writes much and reads nothing cannot block).
#include "qlora/train/reward_command.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

using namespace qlora::train;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

class RewardCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("qlora_reward_command_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A script file in the test's directory; returns the command that runs it.
  std::string script(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return "sh " + p.string();
  }

  std::vector<RewardInput> inputs(size_t n) {
    records_.clear();
    completions_.clear();
    for (size_t k = 0; k < n; ++k) {
      records_.push_back({{"prompt", "p" + std::to_string(k)}, {"answer", k}});
      completions_.push_back("c" + std::to_string(k));
    }
    std::vector<RewardInput> in;
    for (size_t k = 0; k < n; ++k) in.push_back({records_[k], completions_[k], static_cast<int64_t>(k), "x"});
    return in;
  }

  std::string error_of(const std::string& command, size_t n, double timeout_s = 10) {
    try {
      run_reward_command(command, inputs(n), timeout_s);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
  std::vector<json> records_;
  std::vector<std::string> completions_;
};

}  // namespace

TEST_F(RewardCommand, InputIsTheRecordWithTheCompletion) {
  const json rec = {{"prompt", {{{"role", "user"}, {"content", "2+2?"}}}}, {"answer", "4"}, {"level", 3}};
  const std::string text = reward_command_input({{rec, "4\n", 2, "x"}, {rec, "bad \xff", 3, "x"}});
  EXPECT_EQ(text,
            "{\"answer\":\"4\",\"completion\":\"4\\n\",\"completion_tokens\":2,\"level\":3,"
            "\"prompt\":[{\"content\":\"2+2?\",\"role\":\"user\"}]}\n"
            "{\"answer\":\"4\",\"completion\":\"bad \xef\xbf\xbd\",\"completion_tokens\":3,\"level\":3,"
            "\"prompt\":[{\"content\":\"2+2?\",\"role\":\"user\"}]}\n");
}

TEST_F(RewardCommand, ScoresEachLineInOrder) {
  // Reads every line, answers answer + completion_tokens / 10 (fields pass through).
  const std::string cmd = script("score.sh",
                                 "while IFS= read -r line; do\n"
                                 "  a=$(printf '%s' \"$line\" | sed 's/.*\"answer\":\\([0-9]*\\).*/\\1/')\n"
                                 "  t=$(printf '%s' \"$line\" | sed 's/.*\"completion_tokens\":\\([0-9]*\\).*/\\1/')\n"
                                 "  echo \"$a.$t\"\n"
                                 "done\n");
  EXPECT_EQ(run_reward_command(cmd, inputs(3), 10), (std::vector<double>{0.0, 1.1, 2.2}));
  // Spaces, CR and a leading + are fine; no trailing newline is fine.
  EXPECT_EQ(run_reward_command("printf ' +1 \\r\\n-2.5e-1\\n3'", inputs(3), 10), (std::vector<double>{1, -0.25, 3}));
}

TEST_F(RewardCommand, CrashNamesCommandCodeAndStderr) {
  const std::string e = error_of("echo 'Traceback: boom' >&2; exit 3", 2);
  EXPECT_CONTAINS(e, "grpo.reward_command 'echo 'Traceback: boom' >&2; exit 3' exited with code 3");
  EXPECT_CONTAINS(e, "its stderr ends:\nTraceback: boom");
}

TEST_F(RewardCommand, KilledBySignal) {
  const std::string e = error_of("cat > /dev/null; kill -9 $$", 2);
  EXPECT_CONTAINS(e, "was killed by signal 9");
  EXPECT_CONTAINS(e, "(nothing on stderr)");
}

TEST_F(RewardCommand, TimeoutKillsTheProcessGroup) {
  const fs::path pid_file = dir_ / "child.pid";
  const auto start = std::chrono::steady_clock::now();
  const std::string e = error_of("sleep 30 & echo $! > " + pid_file.string() + "; echo waiting >&2; wait", 3, 0.5);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_CONTAINS(e, "did not finish within grpo.reward_timeout_s = 0.5 s on 3 completions and was killed");
  EXPECT_CONTAINS(e, "waiting");
  EXPECT_LT(took, 5.0);
  // The shell's own child (the sleep) went with it.
  pid_t child = 0;
  std::ifstream(pid_file) >> child;
  ASSERT_GT(child, 0);
  bool gone = false;
  for (int k = 0; k < 200 && !gone; ++k) {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string pid, comm, state;
    gone = !(stat >> pid >> comm >> state) || state == "Z";
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(gone) << "pid " << child << " still running";
}

TEST_F(RewardCommand, LineThatIsNotANumber) {
  EXPECT_CONTAINS(error_of("printf '1\\nscore: 0.5\\n'", 2),
                  "': line 2 of its output is \"score: 0.5\", expected a finite number");
  EXPECT_CONTAINS(error_of("printf '1\\nnan\\n'", 2), "line 2 of its output is \"nan\"");
  EXPECT_CONTAINS(error_of("printf '1\\n\\n2\\n'", 3), "line 2 of its output is \"\"");
}

TEST_F(RewardCommand, WrongNumberOfLines) {
  EXPECT_CONTAINS(error_of("echo 1", 2), "wrote 1 lines for 2 completions");
  // More input than a pipe holds, never read: said as a likely cause.
  std::vector<RewardInput> big = inputs(20);
  const std::string text(100000, 'y');
  for (RewardInput& r : big) r.completion = text;
  try {
    run_reward_command("echo 1", big, 10);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_CONTAINS(e.what(), "wrote 1 lines for 20 completions");
    EXPECT_CONTAINS(e.what(), "(it did not read all of its input)");
  }
  EXPECT_CONTAINS(error_of("cat > /dev/null; printf '1\\n2\\n3\\n'", 2), "wrote 3 lines for 2 completions");
  EXPECT_EQ(error_of("cat > /dev/null; printf '1\\n2\\n3\\n'", 2).find("did not read"), std::string::npos);
}

TEST_F(RewardCommand, NoDeadlockOnBigInputAndOutput) {
  // ~4 MB in, never read; 8 MB on stderr before the answers: both far past a pipe's 64 KB.
  std::vector<RewardInput> in = inputs(400);
  const std::string big(10000, 'z');
  for (RewardInput& r : in) r.completion = big;
  const std::string cmd = "head -c 8000000 /dev/zero >&2; yes 0.5 | head -n 400";
  const std::vector<double> v = run_reward_command(cmd, in, 20);
  EXPECT_EQ(v, std::vector<double>(400, 0.5));
  // And a program that reads everything first, then writes.
  EXPECT_EQ(run_reward_command("cat > /dev/null; yes 1 | head -n 400", in, 20), std::vector<double>(400, 1.0));
}

TEST_F(RewardCommand, ThisProcessSurvivesAClosedPipe) {
  // The program exits at once: writing the rest of the input fails (EPIPE), not this process (SIGPIPE).
  std::vector<RewardInput> in = inputs(50);
  const std::string big(100000, 'q');
  for (RewardInput& r : in) r.completion = big;
  EXPECT_EQ(run_reward_command("yes 2 | head -n 50", in, 10), std::vector<double>(50, 2.0));
  EXPECT_CONTAINS(error_of("exec 0<&-; exit 0", 2), "wrote 0 lines for 2 completions");
}
