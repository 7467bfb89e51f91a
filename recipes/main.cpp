// The `qlora` binary.
namespace qlora::recipes {
int qlora_cli(int argc, char** argv);
}

int main(int argc, char** argv) { return qlora::recipes::qlora_cli(argc, argv); }
