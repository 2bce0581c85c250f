// pagedwindow: the plan's page-id pass on the device, for CSR arrays that already live on the GPU.
//
// A plan built from CUDA CSR tensors checks its page ids where they are instead of reading them to the host.
// One kernel, one launch:
//   - every CTA copies its share of qo_indptr, kv_indptr and last_page_len (as int64) into the caller's report,
//     which is mapped pinned host memory (pw_plan_check_host_alloc): the host reads them without a copy;
//   - it reads the page count kv_indptr[batch] on the device and walks kv_indices[0 .. count): each id's range,
//     an int32 copy into ids_out, the largest id, and repeats found with a stamp table (one uint32 per page id,
//     never cleared between passes: a pass stamps each id with its generation, and an id whose old stamp is
//     already this generation was seen before in this pass; the host bumps the generation every pass and clears
//     the table only when the generation wraps);
//   - the findings gather in a device scratch by atomics; the last CTA to finish writes them into the report and
//     zeroes the scratch for the next pass (so no memset is enqueued).
// pw_plan_check_pages launches it and waits on the stream: one launch and one synchronisation per plan.
// Findings (PwPageCheckReport.flags):
//   - kBadCount: kv_indptr[batch] is negative or larger than the entries the pass may read (num_indices);
//   - kOutOfRange: an id below 0 or past int32;
//   - kOutsideTable: an id at or past the stamp table's size (the host grows the table and runs again);
//   - kRepeated: an id seen twice in this pass (inside one request or across requests: the host's pass decides).
// Any flag means the host reads the arrays back and runs its own pass, which names the offending entry.

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

enum PwPageCheckStatus {
  PW_PAGE_CHECK_OK = 0,
  PW_PAGE_CHECK_ERR_NULL_POINTER = -1,  // a required pointer is NULL
  PW_PAGE_CHECK_ERR_BAD_SIZE = -2,      // batch < 1, num_indices < 0, table_size < 0 or generation 0
  PW_PAGE_CHECK_ERR_CAPTURING = -3,     // the stream is capturing a CUDA graph: the pass must wait, so it cannot run
};

// What the host reads after the pass: the findings, then the three small arrays as int64 (batch + 1, batch + 1
// and batch entries, in that order, from `arrays`).
struct PwPageCheckReport {
  int flags;        // pw_page_check::Flags, or-ed over the pass
  int max_id;       // the largest id in range (0 when none)
  long long count;  // kv_indptr[batch] as the pass read it
  long long arrays[1];
};

namespace pw_page_check {

constexpr int kThreads = 256;
constexpr int kIdsPerThread = 4;  // grid: enough CTAs for this many ids per thread, at most kCtasPerSm per SM
constexpr int kCtasPerSm = 8;
constexpr long long kInt32Max = 2147483647;

enum Flags : int {
  kBadCount = 1,
  kOutOfRange = 2,
  kOutsideTable = 4,
  kRepeated = 8,
};

// The device scratch the CTAs gather into: zero before a pass, and zeroed again by the pass's last CTA.
struct Scratch {
  int flags;
  int max_id;
  unsigned done;  // CTAs finished
  int pad;
};

template <typename T>
__device__ __forceinline__ long long load(const void* p, long long i) {
  return static_cast<long long>(static_cast<const T*>(p)[i]);
}

struct Args {
  const void* ids;
  const void* kv_indptr;
  const void* qo_indptr;
  const void* last_page_len;
  int* ids_out;
  unsigned* stamps;
  Scratch* scratch;
  PwPageCheckReport* report;  // mapped host memory
  long long num_indices;
  long long batch;
  long long table_size;
  unsigned generation;
  int qo_is64;
  int last_is64;
};

template <typename Id, typename Ptr>
__global__ void __launch_bounds__(kThreads) pw_page_check_kernel(const Args a) {
  const long long tid = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * kThreads;
  const long long n = a.batch;

  // The small arrays, straight into the report (3 * batch + 2 int64 entries).
  long long* const out = a.report->arrays;
  for (long long i = tid; i < 3 * n + 2; i += stride) {
    long long v;
    if (i <= n) {
      v = a.qo_is64 ? load<long long>(a.qo_indptr, i) : load<int>(a.qo_indptr, i);
    } else if (i <= 2 * n + 1) {
      v = load<Ptr>(a.kv_indptr, i - (n + 1));
    } else {
      v = a.last_is64 ? load<long long>(a.last_page_len, i - (2 * n + 2)) : load<int>(a.last_page_len, i - (2 * n + 2));
    }
    out[i] = v;
  }

  // The page ids.
  const long long count = load<Ptr>(a.kv_indptr, n);
  int flags = 0, high = 0;
  if (count < 0 || count > a.num_indices) {
    flags = kBadCount;
  } else {
    const Id* const ids = static_cast<const Id*>(a.ids);
    for (long long j = tid; j < count; j += stride) {
      const long long id = static_cast<long long>(ids[j]);
      if (id < 0 || id > kInt32Max) {
        flags |= kOutOfRange;
        continue;
      }
      a.ids_out[j] = static_cast<int>(id);
      high = max(high, static_cast<int>(id));
      if (id >= a.table_size) {
        flags |= kOutsideTable;
        continue;
      }
      if (atomicExch(&a.stamps[id], a.generation) == a.generation) flags |= kRepeated;
    }
  }
  flags = static_cast<int>(__reduce_or_sync(0xffffffffu, static_cast<unsigned>(flags)));
  high = __reduce_max_sync(0xffffffffu, high);
  if ((threadIdx.x & 31) == 0) {
    if (flags) atomicOr(&a.scratch->flags, flags);
    if (high) atomicMax(&a.scratch->max_id, high);
  }

  // The last CTA to finish publishes the findings and resets the scratch.
  __shared__ bool last;
  __threadfence();  // this thread's scratch atomics and report writes before the CTA's ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&a.scratch->done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    volatile Scratch* s = a.scratch;
    a.report->flags = s->flags;
    a.report->max_id = s->max_id;
    a.report->count = count;
    s->flags = 0;
    s->max_id = 0;
    s->done = 0;
    __threadfence_system();
  }
}

template <typename Id, typename Ptr>
static void launch(const Args& a, int num_sms, cudaStream_t stream) {
  const long long per_cta = static_cast<long long>(kThreads) * kIdsPerThread;
  const long long work = a.num_indices > 3 * a.batch + 2 ? a.num_indices : 3 * a.batch + 2;
  long long ctas = (work + per_cta - 1) / per_cta;
  const long long most = static_cast<long long>(num_sms > 0 ? num_sms : 1) * kCtasPerSm;
  ctas = ctas < 1 ? 1 : (ctas > most ? most : ctas);
  pw_page_check_kernel<Id, Ptr><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(a);
}

}  // namespace pw_page_check

// The launch parameter block (mirrored by a ctypes.Structure in src/pagedwindow/cuda/host_pass.py; the host
// checks sizeof against pw_page_check_launch_size()). Device pointers unless marked host.
struct PwPageCheckLaunch {
  const void* kv_indices;     // [>= num_indices] int32 or int64
  const void* kv_indptr;      // [batch + 1]
  const void* qo_indptr;      // [batch + 1]
  const void* last_page_len;  // [batch]
  int* ids_out;               // [num_indices] int32: the ids, copied
  unsigned* stamps;           // [table_size] the stamp table
  void* scratch;              // pw_plan_check_scratch_bytes() of device memory, zero before the first pass
  PwPageCheckReport* report;  // host (mapped, pw_plan_check_host_alloc): room for 3 * batch + 2 arrays entries
  long long num_indices;      // entries the pass may read (at most len(kv_indices)) and write
  long long batch;
  long long table_size;
  unsigned generation;  // nonzero; differs from every stamp left by an earlier pass unless the table was cleared
  int indices_is64;
  int kv_is64;
  int qo_is64;
  int last_is64;
  int num_sms;
};

// Launch the pass on `stream` and wait for it. Returns 0, a negative status (nothing launched) or a cudaError_t.
extern "C" int pw_plan_check_pages(const PwPageCheckLaunch* a, void* stream_handle) {
  using namespace pw_page_check;
  if (a == nullptr || a->kv_indices == nullptr || a->kv_indptr == nullptr || a->qo_indptr == nullptr ||
      a->last_page_len == nullptr || a->ids_out == nullptr || a->stamps == nullptr || a->scratch == nullptr ||
      a->report == nullptr)
    return PW_PAGE_CHECK_ERR_NULL_POINTER;
  if (a->batch < 1 || a->num_indices < 0 || a->table_size < 0 || a->generation == 0) return PW_PAGE_CHECK_ERR_BAD_SIZE;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (capture != cudaStreamCaptureStatusNone) return PW_PAGE_CHECK_ERR_CAPTURING;
  const Args args{a->kv_indices,
                  a->kv_indptr,
                  a->qo_indptr,
                  a->last_page_len,
                  a->ids_out,
                  a->stamps,
                  static_cast<Scratch*>(a->scratch),
                  a->report,
                  a->num_indices,
                  a->batch,
                  a->table_size,
                  a->generation,
                  a->qo_is64,
                  a->last_is64};
  const bool ids64 = a->indices_is64 != 0, kv64 = a->kv_is64 != 0;
  auto* const launcher = ids64 ? (kv64 ? launch<long long, long long> : launch<long long, int>)
                               : (kv64 ? launch<int, long long> : launch<int, int>);
  launcher(args, a->num_sms, stream);
  err = cudaGetLastError();
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(cudaStreamSynchronize(stream));
}

// Mapped pinned host memory for a report (the kernel writes it, the host reads it): *host receives the address
// (the same on the device, under unified addressing). Returns a cudaError_t.
extern "C" int pw_plan_check_host_alloc(long long bytes, void** host) {
  return static_cast<int>(cudaHostAlloc(host, static_cast<size_t>(bytes), cudaHostAllocMapped | cudaHostAllocPortable));
}

extern "C" int pw_plan_check_host_free(void* host) { return static_cast<int>(cudaFreeHost(host)); }

extern "C" int pw_page_check_launch_size(void) { return static_cast<int>(sizeof(PwPageCheckLaunch)); }

extern "C" int pw_plan_check_scratch_bytes(void) { return static_cast<int>(sizeof(pw_page_check::Scratch)); }

extern "C" long long pw_plan_check_report_bytes(long long batch) {
  return static_cast<long long>(offsetof(PwPageCheckReport, arrays)) + (3 * batch + 2) * 8;
}
