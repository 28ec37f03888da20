// A device for the CPU test suite whose memory is host memory: tensors on it have a real
// non-CPU device type (PrivateUse1, renamed from Python to "neuron" or another name, and XLA),
// every op runs through the CPU kernels (at::native::cpu_fallback, what torch_xla and
// out-of-tree backends use for ops they do not implement), views alias, copies cross between
// the device and the CPU. What it is for: code that sends a CPU tensor where only device
// tensors are accepted fails here as on hardware, and code that stages on the device passes.
// It says nothing about a device's numerics, memory or speed.
//
// Built by tests/fakes/device/__init__.py (torch.utils.cpp_extension, once per source and torch
// version); no Python bindings: everything registers when the library is loaded.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {
using c10::DeviceType;

template <DeviceType D>
struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    return {p, p, &c10::free_cpu, c10::Device(D, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &c10::free_cpu; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
HostAllocator<DeviceType::PrivateUse1> privateuse1_allocator;
HostAllocator<DeviceType::XLA> xla_allocator;

template <DeviceType D>
c10::Allocator* allocator() {
  if constexpr (D == DeviceType::XLA) return &xla_allocator;
  return &privateuse1_allocator;
}

// Synchronous host memory: one device (index 0), one stream, every event already complete.
template <DeviceType D>
struct Guard final : c10::impl::DeviceGuardImplInterface {
  static c10::Device dev() { return c10::Device(D, 0); }
  static c10::Stream stream() { return c10::Stream(c10::Stream::DEFAULT, dev()); }
  DeviceType type() const override { return D; }
  c10::Device exchangeDevice(c10::Device) const override { return dev(); }
  c10::Device getDevice() const override { return dev(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return stream(); }
  c10::Stream getDefaultStream(c10::Device) const override { return stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return stream(); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override { return stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return stream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    *event = reinterpret_cast<void*>(1);
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(DeviceType::PrivateUse1, 0); }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    auto fresh = privateuse1_allocator.allocate(newsize);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

// The same memory seen as a CPU tensor (no copy).
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() == DeviceType::CPU) return t;
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), t.storage().nbytes(),
                              at::DataPtr(t.storage().data_ptr().get(), c10::Device(DeviceType::CPU)),
                              nullptr, false);
  auto cpu = at::empty({0}, t.options().device(DeviceType::CPU));
  cpu.set_(storage, t.storage_offset(), t.sizes(), t.strides());
  return cpu;
}

template <DeviceType D, c10::DispatchKey K>
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device>, std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, allocator<D>(), c10::DispatchKeySet(K), c10::dtype_or_default(dtype),
                                   memory_format);
}

template <DeviceType D, c10::DispatchKey K>
at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, allocator<D>(), c10::DispatchKeySet(K),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

template <DeviceType D>
const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat>) {
  // Grow the storage in place (host memory), then restride: what resize_ does on any device.
  auto* impl = self.unsafeGetTensorImpl();
  int64_t numel = c10::multiply_integers(size);
  size_t need = (self.storage_offset() + numel) * self.dtype().itemsize();
  auto* storage = impl->storage().unsafeGetStorageImpl();
  if (need > storage->nbytes()) {
    auto fresh = allocator<D>()->allocate(need);
    if (storage->nbytes()) std::memcpy(fresh.get(), storage->data(), storage->nbytes());
    storage->set_data_ptr_noswap(std::move(fresh));
    storage->set_nbytes(need);
  }
  impl->set_sizes_contiguous(size);
  return self;
}

at::Scalar local_scalar_dense(const at::Tensor& self) { return at::_local_scalar_dense(host_alias(self)); }

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { at::native::cpu_fallback(op, stack); }

template <DeviceType D, c10::DispatchKey K>
void register_kernels(torch::Library& m) {
  m.impl("empty.memory_format", empty_memory_format<D, K>);
  m.impl("empty_strided", empty_strided<D, K>);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize_<D>);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", at::native::set_storage_cpu_);
}
}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard<DeviceType::PrivateUse1>);
C10_REGISTER_GUARD_IMPL(XLA, Guard<DeviceType::XLA>);

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  register_kernels<DeviceType::PrivateUse1, c10::DispatchKey::PrivateUse1>(m);
}
TORCH_LIBRARY_IMPL(aten, XLA, m) { register_kernels<DeviceType::XLA, c10::DispatchKey::XLA>(m); }
TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }
TORCH_LIBRARY_IMPL(_, XLA, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

namespace {
struct RegisterAtLoad {
  RegisterAtLoad() {
    c10::SetAllocator(DeviceType::PrivateUse1, &privateuse1_allocator);
    c10::SetAllocator(DeviceType::XLA, &xla_allocator);
    at::RegisterPrivateUse1HooksInterface(new Hooks());
  }
} register_at_load;
}  // namespace
