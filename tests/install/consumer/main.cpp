// Uses the installed library: parses a config and prints its hash and the learning rate.
#include <kiln/config.h>

#include <cstdio>

int main() {
  kiln::Config config = kiln::Config::parse("[optim]\nlr = 0.25\n", "consumer");
  std::printf("lr=%g hash=%s\n", config.get_float("optim.lr"), config.hash().c_str());
  return config.get_float("optim.lr") == 0.25 ? 0 : 1;
}
