// The plan's host pass in compiled code: validate FlashInfer-style CSR arrays and pack the plan block the kernels
// read, in one pass over the page ids; and upload a packed plan into its device buffer in one call.
//
// pw_plan_pack is the fast path of pagedwindow.plan._state_from_csr and must agree with it exactly: it returns
// PW_PACK_OK only where the vectorised check would accept the batch, and then writes the same block. On any
// other status nothing it wrote is used: the caller runs the vectorised check, which names the offending entry
// (or, for page ids shared between requests, decides whether the sharing is legal).
//
// Block layout (int32, every segment exactly full; pagedwindow.plan.PlanCapacity.segment_sizes):
//   [0..3)  batch, total_tokens, num_tiles
//   page_indptr [batch + 1], last_page_len [batch], qo_indptr [batch + 1],
//   request_indices [num_tiles], qo_tile_indices [num_tiles], page_indices [total_pages]
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef PW_HOST_ONLY
#include <cuda_runtime.h>
#endif

namespace {

constexpr int64_t kInt32Max = 2147483647;
constexpr int64_t kDenseTableMin = int64_t{1} << 20;  // as plan._check_shared_pages: a table below this size

// One CSR array as the caller holds it: int32 or int64, contiguous.
struct Ints {
  const void* data;
  int is64;
  int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

// Copy page ids into the block as int32; returns the largest, or -1 when one is outside 0..int32.
int64_t copy_page_ids(const int64_t* ids, int64_t n, int32_t* out) {
  int64_t low = 0, high = -1;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t id = ids[j];
    low = id < low ? id : low;
    high = id > high ? id : high;
    out[j] = static_cast<int32_t>(id);
  }
  return (low < 0 || high > kInt32Max) ? -1 : high;
}

// int32 ids: one unsigned maximum covers both bounds (a negative id reads as one above int32's maximum), and the
// loop stays in 32-bit lanes.
int64_t copy_page_ids(const int32_t* ids, int64_t n, int32_t* out) {
  uint32_t high = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t id = static_cast<uint32_t>(ids[j]);
    high = id > high ? id : high;
    out[j] = ids[j];
  }
  if (n == 0) return -1;  // as the int64 overload: no largest id
  return high > static_cast<uint32_t>(kInt32Max) ? -1 : static_cast<int64_t>(high);
}

// The tiles whose counts the tile policy reads (pagedwindow.tiles.SUPPORTED_CTA_TILE_Q, in order).
constexpr int64_t kPolicyTiles[3] = {16, 64, 128};

}  // namespace

enum PwPackStatus {
  PW_PACK_OK = 0,
  PW_PACK_INVALID = 1,    // a rule is broken: the vectorised check names it
  PW_PACK_SHARED = 2,     // a page id appears twice: the vectorised check decides
  PW_PACK_SPARSE = 3,     // page ids too sparse for a table: the vectorised check sorts
  PW_PACK_TOO_SMALL = 4,  // the block the caller gave is too small (a caller bug)
};

constexpr int PW_PACK_SCALARS = 11;  // pagedwindow.plan._PACK_SCALARS

// Where each segment of the block starts (the layout above), for `batch` requests and `num_tiles` tiles.
struct BlockOffsets {
  int64_t page_indptr, last, qo, request, qo_tile, pages;
  BlockOffsets(int64_t batch, int64_t num_tiles)
      : page_indptr(3),
        last(page_indptr + batch + 1),
        qo(last + batch),
        request(qo + batch + 1),
        qo_tile(request + num_tiles),
        pages(qo_tile + num_tiles) {}
};

// The tile list of a packed block at `tile`, request by request: request i's ceil(seq_i * group / tile) tiles, its
// query tiles 0, 1, ... in order (seq_i from the block's qo_indptr segment).
static void write_tiles(int32_t* packed, const BlockOffsets& o, int64_t group, int64_t tile) {
  const int64_t batch = packed[0];
  const int32_t* qo = packed + o.qo;
  int64_t t = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t n = (int64_t{qo[i + 1] - qo[i]} * group + tile - 1) / tile;
    for (int64_t k = 0; k < n; ++k, ++t) {
      packed[o.request + t] = static_cast<int32_t>(i);
      packed[o.qo_tile + t] = static_cast<int32_t>(k);
    }
  }
}

// The tile list of a packed block, built request by request, reordered longest first (plan.py's _tiles): by the
// end of the tile's keys, one past its last query position (start + ceil(rows_end / group)), largest first, ties
// in list order. No sort when the list is already in that order (one request per tile of equal kv_len, say).
static void order_longest_first(int32_t* packed, const int32_t* start, int64_t group, int64_t tile) {
  const int64_t num_tiles = packed[2];
  const BlockOffsets o(packed[0], num_tiles);
  const int32_t* qo = packed + o.qo;
  int32_t* requests = packed + o.request;
  int32_t* qo_tiles = packed + o.qo_tile;
  static thread_local std::vector<int64_t> keys;
  static thread_local std::vector<int32_t> order, scratch;
  keys.resize(num_tiles);
  bool sorted = true;
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t i = requests[t], rows = int64_t{qo[i + 1] - qo[i]} * group, end = (qo_tiles[t] + int64_t{1}) * tile;
    keys[t] = start[i] + ((end < rows ? end : rows) + group - 1) / group;
    sorted = sorted && (t == 0 || keys[t] <= keys[t - 1]);
  }
  if (sorted) return;
  order.resize(num_tiles);
  for (int64_t t = 0; t < num_tiles; ++t) order[t] = static_cast<int32_t>(t);
  std::stable_sort(order.begin(), order.end(), [](int32_t x, int32_t y) { return keys[x] > keys[y]; });
  scratch.resize(num_tiles);
  for (int32_t* column : {requests, qo_tiles}) {
    for (int64_t t = 0; t < num_tiles; ++t) scratch[t] = column[order[t]];
    std::memcpy(column, scratch.data(), num_tiles * sizeof(int32_t));
  }
}

extern "C" {

// Validate and pack. scalars [PW_PACK_SCALARS] receives max_page_index, max_last_page_len, total_tokens,
// total_pages, num_tiles (at `tile`), then what the tile policy reads: the most packed rows (seq_len * group) of
// one request, the longest kv_len, the requests with new rows, and the tiles at each of kPolicyTiles (each
// within int32 once validated); start_positions [batch] receives kv_len - seq_len per request.
// A null kv_indices means the page ids were checked and copied on the device (kernels/plan_check.cu): only
// num_indices is used, the block's page segment is left unwritten and max_page_index is -1. order_tiles 0 leaves
// the tile list request by request (a pass whose tile the policy may still change; pw_plan_retile lays it out at
// the tile the policy picks), else it is ordered longest first.
int pw_plan_pack(const void* qo_indptr, int qo_is64, const void* kv_indptr, int kv_is64, const void* kv_indices,
                 int indices_is64, int64_t num_indices, const void* last_page_len, int last_is64, int64_t batch,
                 int64_t page_size, int64_t group, int64_t tile, int32_t* packed, int64_t packed_capacity,
                 int32_t* start_positions, int32_t* scalars, int order_tiles) {
  const Ints qo{qo_indptr, qo_is64}, kv{kv_indptr, kv_is64}, last{last_page_len, last_is64};
  if (batch < 1 || batch > kInt32Max || page_size < 1 || group < 1 || tile < 1) return PW_PACK_INVALID;
  // Indptrs: start at 0, never above int32, seq_len >= 0 and at least one page per request. Last page
  // lengths in 1..page_size, kv_len within int32, seq_len <= kv_len. Tiles per request: ceil(seq * group / tile).
  if (qo[0] != 0 || kv[0] != 0) return PW_PACK_INVALID;
  int64_t num_tiles = 0, max_last = 0, max_rows = 0, max_kv_len = 0, busy = 0;
  int64_t policy_tiles[3] = {0, 0, 0};
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t q1 = qo[i + 1], k1 = kv[i + 1], l = last[i];
    if (q1 < qo[i] || q1 > kInt32Max || k1 < kv[i] + 1 || k1 > kInt32Max || l < 1 || l > page_size)
      return PW_PACK_INVALID;
    const int64_t seq = q1 - qo[i];
    const int64_t kv_len = (k1 - kv[i] - 1) * page_size + l;
    if (kv_len > kInt32Max || seq > kv_len) return PW_PACK_INVALID;
    const int64_t rows = seq * group;
    num_tiles += (rows + tile - 1) / tile;
    for (int k = 0; k < 3; ++k) policy_tiles[k] += (rows + kPolicyTiles[k] - 1) / kPolicyTiles[k];
    if (l > max_last) max_last = l;
    if (rows > max_rows) max_rows = rows;
    if (kv_len > max_kv_len) max_kv_len = kv_len;
    busy += seq > 0;
  }
  const int64_t total_tokens = qo[batch], total_pages = kv[batch];
  if (total_pages > num_indices || total_tokens * group > kInt32Max || num_tiles > kInt32Max) return PW_PACK_INVALID;
  const BlockOffsets o(batch, num_tiles);
  if (o.pages + total_pages > packed_capacity) return PW_PACK_TOO_SMALL;

  // Page ids: within 0..int32, each used once (a table of the ids seen), copied into the block.
  int32_t* pages = packed + o.pages;
  int64_t high = -1;
  if (kv_indices != nullptr) {
    high = indices_is64 ? copy_page_ids(static_cast<const int64_t*>(kv_indices), total_pages, pages)
                        : copy_page_ids(static_cast<const int32_t*>(kv_indices), total_pages, pages);
    if (high < 0) return PW_PACK_INVALID;
  }
  if (kv_indices != nullptr && total_pages >= 2) {
    const int64_t table_limit = 4 * total_pages > kDenseTableMin ? 4 * total_pages : kDenseTableMin;
    if (high >= table_limit) return PW_PACK_SPARSE;
    static thread_local std::vector<uint8_t> seen_ids;
    if (static_cast<int64_t>(seen_ids.size()) < high + 1) seen_ids.resize(high + 1);
    uint8_t* seen = seen_ids.data();  // one thread-local lookup, not one per id
    std::memset(seen, 0, high + 1);
    uint8_t repeated = 0;
    for (int64_t j = 0; j < total_pages; ++j) {
      repeated |= seen[pages[j]];
      seen[pages[j]] = 1;
    }
    if (repeated) return PW_PACK_SHARED;
  }

  packed[0] = static_cast<int32_t>(batch);
  packed[1] = static_cast<int32_t>(total_tokens);
  packed[2] = static_cast<int32_t>(num_tiles);
  for (int64_t i = 0; i <= batch; ++i) {
    packed[o.page_indptr + i] = static_cast<int32_t>(kv[i]);
    packed[o.qo + i] = static_cast<int32_t>(qo[i]);
    if (i == batch) break;
    const int64_t l = last[i], seq = qo[i + 1] - qo[i];
    packed[o.last + i] = static_cast<int32_t>(l);
    start_positions[i] = static_cast<int32_t>((kv[i + 1] - kv[i] - 1) * page_size + l - seq);
  }
  write_tiles(packed, o, group, tile);
  if (order_tiles) order_longest_first(packed, start_positions, group, tile);
  scalars[0] = static_cast<int32_t>(high);
  scalars[1] = static_cast<int32_t>(max_last);
  scalars[2] = static_cast<int32_t>(total_tokens);
  scalars[3] = static_cast<int32_t>(total_pages);
  scalars[4] = static_cast<int32_t>(num_tiles);
  scalars[5] = static_cast<int32_t>(max_rows);
  scalars[6] = static_cast<int32_t>(max_kv_len);
  scalars[7] = static_cast<int32_t>(busy);
  static_assert(8 + 3 == PW_PACK_SCALARS, "the scalars' layout");
  for (int k = 0; k < 3; ++k) scalars[8 + k] = static_cast<int32_t>(policy_tiles[k]);
  return PW_PACK_OK;
}

// The tile list of a block pw_plan_pack packed with order_tiles 0, laid out again at `tile` (the tile the policy
// picked: the same one, or another) and ordered longest first, in place: the page ids move with the end of the
// tile segments, and packed[2] and scalars[4] take the new tile count. Nothing else is read again, so a plan the
// policy moves off the pass's tile costs a walk over the requests, not a second pass over the page ids.
// start_positions as pw_plan_pack wrote them; packed_capacity as it was given.
int pw_plan_retile(int32_t* packed, int64_t packed_capacity, const int32_t* start_positions, int64_t group,
                   int64_t tile, int32_t* scalars) {
  if (group < 1 || tile < 1) return PW_PACK_INVALID;
  const int64_t batch = packed[0], packed_tiles = packed[2];
  const BlockOffsets before(batch, packed_tiles);
  const int32_t* qo = packed + before.qo;
  int64_t num_tiles = 0;
  for (int64_t i = 0; i < batch; ++i) num_tiles += (int64_t{qo[i + 1] - qo[i]} * group + tile - 1) / tile;
  if (num_tiles > kInt32Max) return PW_PACK_INVALID;
  const BlockOffsets after(batch, num_tiles);
  const int64_t total_pages = packed[before.page_indptr + batch];
  if (after.pages + total_pages > packed_capacity) return PW_PACK_TOO_SMALL;
  // The same count means the same list: every request has as many tiles at either tile (fewer at the larger one
  // each, and the sums equal), so only the order is left to set.
  if (num_tiles != packed_tiles) {
    // The page ids first: the new tile segments may end where they start.
    std::memmove(packed + after.pages, packed + before.pages, total_pages * sizeof(int32_t));
    packed[2] = static_cast<int32_t>(num_tiles);
    write_tiles(packed, after, group, tile);
  }
  order_longest_first(packed, start_positions, group, tile);
  scalars[4] = static_cast<int32_t>(num_tiles);
  return PW_PACK_OK;
}

#ifndef PW_HOST_ONLY
// Upload a packed plan: wait for the previous copy from this staging buffer (its event, *event; a null event is
// created instead, as nothing used the buffer yet), copy the live segments into the pinned staging buffer at
// their capacity offsets, enqueue one or two host-to-device copies of the live range on the stream, record the
// event. offsets [7]: the capacity layout's segment offsets; sizes [7]: the packed block's segment sizes.
// max_gap: unused tile entries copied along rather than split into two copies. device_pages: null, or the page
// ids already on this device (sizes[6] of them, checked there): then packed's page segment is not read, and the
// ids are copied device to device. Returns a cudaError_t.
int pw_plan_upload(int32_t* device_buffer, int32_t* staging, const int32_t* packed, const int64_t* offsets,
                   const int64_t* sizes, int64_t max_gap, const int32_t* device_pages, cudaStream_t stream,
                   cudaEvent_t* event) {
  cudaError_t err = *event ? cudaEventSynchronize(*event) : cudaEventCreateWithFlags(event, cudaEventDisableTiming);
  if (err != cudaSuccess) return err;
  const int host_segments = device_pages ? 6 : 7;
  int64_t src = 0;
  for (int s = 0; s < host_segments; ++s) {
    std::memcpy(staging + offsets[s], packed + src, sizes[s] * sizeof(int32_t));
    src += sizes[s];
  }
  const int64_t head_end = offsets[5] + sizes[5], pages_end = offsets[6] + sizes[6];
  if (device_pages) {
    err = cudaMemcpyAsync(device_buffer, staging, head_end * sizeof(int32_t), cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess)
      err = cudaMemcpyAsync(device_buffer + offsets[6], device_pages, sizes[6] * sizeof(int32_t),
                            cudaMemcpyDeviceToDevice, stream);
  } else if (offsets[6] - head_end <= max_gap) {
    err = cudaMemcpyAsync(device_buffer, staging, pages_end * sizeof(int32_t), cudaMemcpyHostToDevice, stream);
  } else {
    err = cudaMemcpyAsync(device_buffer, staging, head_end * sizeof(int32_t), cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess)
      err = cudaMemcpyAsync(device_buffer + offsets[6], staging + offsets[6], sizes[6] * sizeof(int32_t),
                            cudaMemcpyHostToDevice, stream);
  }
  if (err != cudaSuccess) return err;
  return cudaEventRecord(*event, stream);
}

// Destroy the events pw_plan_upload created (null entries are skipped; each is reset to null).
void pw_plan_events_destroy(cudaEvent_t* events, int n) {
  for (int i = 0; i < n; ++i) {
    if (events[i]) cudaEventDestroy(events[i]);
    events[i] = nullptr;
  }
}
#endif

}  // extern "C"
