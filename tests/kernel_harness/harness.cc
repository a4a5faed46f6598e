// engine/native.cc's kernels as a command: reads a kernel's name and operands from stdin, writes its
// result to stdout. tests/test_native.py builds it for a tier this machine cannot load into XLA (the
// NEON tier: cross-compiled, run under qemu-user) and holds it to the same numpy definitions as the
// tiers XLA calls. Built with -I tests/kernel_harness, whose xla/ffi/api/ffi.h stands in for XLA's.
//
// "tiles_check" and a newline on stdin: mashbox_tiles_check's verdict as the exit status. Otherwise,
// stdin: the name and a newline; int32 the number of operands, int32 how many of them (the last)
// are results; per operand uint8 its type (xla::ffi::DataType's order), uint8 its rank, int64
// dims[rank], then (inputs only) its bytes. stdout: the results' bytes, one after another. A
// kernel's error: its message on stderr, exit status 2.
#include "../../engine/native.cc"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>

namespace {

struct Operand {
  ffi::DataType type;
  std::vector<int64_t> dims;
  std::vector<uint8_t> bytes;
};

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::exit(2);
}

void Read(void* to, size_t n) {
  if (n && std::fread(to, 1, n, stdin) != n) Fail("harness: stdin ended early");
}

template <typename T>
T ReadOne() {
  T value;
  Read(&value, sizeof value);
  return value;
}

size_t ElementBytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U8: case ffi::DataType::S8: return 1;
    case ffi::DataType::F16: case ffi::DataType::BF16: return 2;
    default: return 4;
  }
}

template <ffi::DataType D>
ffi::Buffer<D> Typed(Operand& o) {
  if (o.type != D) Fail("harness: an operand of another type than the kernel takes");
  return ffi::Buffer<D>(o.bytes.data(), o.dims);
}

// One handler parameter from operand i - 1 (parameter 0 is the pool).
template <typename P> struct Arg;
template <> struct Arg<ffi::ThreadPool> {
  static ffi::ThreadPool From(std::vector<Operand>&, size_t) { return {}; }
};
template <> struct Arg<ffi::AnyBuffer> {
  static ffi::AnyBuffer From(std::vector<Operand>&, size_t) { return {}; }
};
template <ffi::DataType D> struct Arg<ffi::Buffer<D>> {
  static ffi::Buffer<D> From(std::vector<Operand>& ops, size_t i) { return Typed<D>(ops[i - 1]); }
};
template <ffi::DataType D> struct Arg<ffi::ResultBuffer<D>> {
  static ffi::ResultBuffer<D> From(std::vector<Operand>& ops, size_t i) {
    return ffi::ResultBuffer<D>(new ffi::Buffer<D>(Typed<D>(ops[i - 1])));   // lives until exit
  }
};

template <typename... P, size_t... I>
ffi::Error Invoke(ffi::Error (*fn)(P...), std::vector<Operand>& ops, std::index_sequence<I...>) {
  if (ops.size() + 1 != sizeof...(P)) Fail("harness: the kernel takes another number of operands");
  return fn(Arg<P>::From(ops, I)...);
}

template <typename... P>
ffi::Error Call(ffi::Error (*fn)(P...), std::vector<Operand>& ops) {
  return Invoke(fn, ops, std::index_sequence_for<P...>{});
}

// engine/native.py's custom call targets, without the "mashbox_" prefix.
const std::map<std::string, ffi::Error (*)(std::vector<Operand>&)> kKernels = {
    {"int8_matmul", [](std::vector<Operand>& o) { return Call(Int8Matmul, o); }},
    {"int8_widen", [](std::vector<Operand>& o) { return Call(Int8Widen, o); }},
    {"int8_attend", [](std::vector<Operand>& o) { return Call(Int8Attend, o); }},
    {"int5_matmul", [](std::vector<Operand>& o) { return Call(Int5Matmul, o); }},
    {"int5_widen", [](std::vector<Operand>& o) { return Call(Int5Widen, o); }},
    {"q8_matmul", [](std::vector<Operand>& o) { return Call(Q8Matmul, o); }},
    {"q8_widen", [](std::vector<Operand>& o) { return Call(Q8Widen, o); }},
    {"q4k_matmul", [](std::vector<Operand>& o) { return Call(Q4KMatmul, o); }},
    {"q5k_matmul", [](std::vector<Operand>& o) { return Call(Q5KMatmul, o); }},
    {"q6k_matmul", [](std::vector<Operand>& o) { return Call(Q6KMatmul, o); }},
    {"q4k_widen", [](std::vector<Operand>& o) { return Call(Q4KWiden, o); }},
    {"q5k_widen", [](std::vector<Operand>& o) { return Call(Q5KWiden, o); }},
    {"q6k_widen", [](std::vector<Operand>& o) { return Call(Q6KWiden, o); }},
    {"iq4nl_matmul", [](std::vector<Operand>& o) { return Call(Iq4NlMatmul, o); }},
    {"iq4nl_widen", [](std::vector<Operand>& o) { return Call(Iq4NlWiden, o); }},
    {"iq4xs_matmul", [](std::vector<Operand>& o) { return Call(Iq4XsMatmul, o); }},
    {"iq4xs_widen", [](std::vector<Operand>& o) { return Call(Iq4XsWiden, o); }},
    {"iq3s_matmul", [](std::vector<Operand>& o) { return Call(Iq3SMatmul, o); }},
    {"iq3s_widen", [](std::vector<Operand>& o) { return Call(Iq3SWiden, o); }},
    {"q3k_matmul", [](std::vector<Operand>& o) { return Call(Q3KMatmul, o); }},
    {"q3k_widen", [](std::vector<Operand>& o) { return Call(Q3KWiden, o); }},
    {"row_dot", [](std::vector<Operand>& o) { return Call(RowDot, o); }},
    {"delta_steps", [](std::vector<Operand>& o) { return Call(DeltaSteps, o); }},
    {"delta_steps_in_place", [](std::vector<Operand>& o) { return Call(DeltaStepsInPlace, o); }},
    {"first_max", [](std::vector<Operand>& o) { return Call(FirstMax, o); }},
    {"filter_cuts", [](std::vector<Operand>& o) { return Call(FilterCuts, o); }},
};

}  // namespace

int main() {
  std::string name;
  for (int c; (c = std::fgetc(stdin)) != '\n';) {
    if (c == EOF) Fail("harness: no kernel name");
    name.push_back(static_cast<char>(c));
  }
  if (name == "tiles_check") return mashbox_tiles_check();   // its verdict as the exit status
  const auto kernel = kKernels.find(name);
  if (kernel == kKernels.end()) Fail("harness: no kernel " + name);
  std::vector<Operand> ops(ReadOne<int32_t>());
  const size_t results = ReadOne<int32_t>();
  if (results < 1 || results > ops.size()) Fail("harness: no result operand");
  for (size_t i = 0; i < ops.size(); i++) {
    Operand& o = ops[i];
    o.type = static_cast<ffi::DataType>(ReadOne<uint8_t>());
    o.dims.resize(ReadOne<uint8_t>());
    size_t n = ElementBytes(o.type);
    for (int64_t& d : o.dims) n *= static_cast<size_t>(d = ReadOne<int64_t>());
    o.bytes.resize(n);
    if (i + results < ops.size()) Read(o.bytes.data(), n);
  }
  const ffi::Error error = kernel->second(ops);
  if (error.failure()) Fail(error.message());
  for (size_t i = ops.size() - results; i < ops.size(); i++) {
    const std::vector<uint8_t>& out = ops[i].bytes;
    if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size()) Fail("harness: stdout closed");
  }
  return 0;
}
