// The part of XLA's FFI header that engine/native.cc uses, for tests/kernel_harness/harness.cc:
// buffers over plain memory, a pool of one thread (every task on the caller) and no registration.
// It lets the kernel be built where no jaxlib for the target exists (a cross-compiled tier run
// under qemu-user) and called on buffers numpy wrote.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace xla::ffi {

enum class DataType { F32, U8, S8, U32, F16, BF16, S32 };
inline constexpr DataType F32 = DataType::F32, U8 = DataType::U8, S8 = DataType::S8, U32 = DataType::U32,
                          F16 = DataType::F16, BF16 = DataType::BF16, S32 = DataType::S32;

template <DataType T> struct Native;
template <> struct Native<DataType::F32> { using type = float; };
template <> struct Native<DataType::U8> { using type = uint8_t; };
template <> struct Native<DataType::S8> { using type = int8_t; };
template <> struct Native<DataType::U32> { using type = uint32_t; };
template <> struct Native<DataType::F16> { using type = uint16_t; };
template <> struct Native<DataType::BF16> { using type = uint16_t; };
template <> struct Native<DataType::S32> { using type = int32_t; };

template <typename T>
class Span {
 public:
  Span(T* data, size_t size) : data_(data), size_(size) {}
  size_t size() const { return size_; }
  T& operator[](size_t i) const { return data_[i]; }
  T* begin() const { return data_; }
  T* end() const { return data_ + size_; }

 private:
  T* data_;
  size_t size_;
};

template <DataType T>
class Buffer {
 public:
  using Element = typename Native<T>::type;
  Buffer(void* data, std::vector<int64_t> dims) : data_(static_cast<Element*>(data)), dims_(std::move(dims)) {}
  Span<const int64_t> dimensions() const { return {dims_.data(), dims_.size()}; }
  int64_t element_count() const {
    int64_t n = 1;
    for (int64_t d : dims_) n *= d;
    return n;
  }
  Element* typed_data() const { return data_; }

 private:
  Element* data_;
  std::vector<int64_t> dims_;
};

template <DataType T>
class ResultBuffer {
 public:
  explicit ResultBuffer(Buffer<T>* buffer) : buffer_(buffer) {}
  Buffer<T>* operator->() const { return buffer_; }

 private:
  Buffer<T>* buffer_;
};

struct AnyBuffer {};

class Error {
 public:
  static Error Success() { return Error(""); }
  static Error InvalidArgument(std::string message) { return Error(std::move(message)); }
  bool failure() const { return !message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  explicit Error(std::string message) : message_(std::move(message)) {}
  std::string message_;
};

class ThreadPool {
 public:
  int64_t num_threads() const { return 1; }
  void Schedule(std::function<void()> task) { task(); }
};

}  // namespace xla::ffi

// Registration is XLA's business: here the handlers are called directly.
#define XLA_FFI_DEFINE_HANDLER_SYMBOL(...)
