// ArrayView: the client's read-only view of the caller's arrays (a batch's columns, a
// verifier's drafts and probabilities).
#pragma once

#include <cstddef>
#include <vector>

namespace mtpdraft {

// A read-only view of `size` contiguous values the caller owns, such as one column of a
// verifier's step: it must outlive the call it is passed to. Made from a std::vector (not a
// temporary one) or a pointer and a count; empty by default.
template <typename T>
class ArrayView {
 public:
  ArrayView() = default;
  ArrayView(const T* data, size_t size) : data_(data), size_(size) {}
  ArrayView(const std::vector<T>& values)  // NOLINT(runtime/explicit): a vector is a column
      : data_(values.data()), size_(values.size()) {}
  ArrayView(std::vector<T>&&) = delete;  // the view would outlive the values

  const T* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  const T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace mtpdraft
