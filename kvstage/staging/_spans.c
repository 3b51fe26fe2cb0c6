/* Copies of many byte spans in one call, for kvstage's host gathers and scatters
 * (kvstage/staging/hostcopy.py loads this with ctypes; it has no Python API).
 *
 * Why native: numpy and torch copy a few-KiB row with ordinary stores, which
 * read every destination line before writing it. Streaming (non-temporal)
 * stores skip that read, so each destination line costs one memory transfer
 * instead of two. The
 * bytes are not read again soon (they go to a transport or to decode pages),
 * so keeping them out of the cache costs nothing.
 *
 * No bounds are checked here: the caller (hostcopy.SpanCopy) checks every span
 * against its buffers before any call. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static void copy_streaming(char *d, const char *s, size_t n)
{
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (n < head + 64) {
        memcpy(d, s, n);
        return;
    }
    if (head) {
        memcpy(d, s, head);
        d += head, s += head, n -= head;
    }
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    if (n > body)
        memcpy(d + body, s + body, n - body);
#else
    memcpy(d, s, n);
#endif
}

/* For each block b and span i: copy len[i] bytes from src_base[b] + src_off[i]
 * to dst_base[b] + dst_off[i]; with streaming stores where the CPU has them. */
void kvstage_copy_spans(const uint64_t *dst_base, const uint64_t *src_base, size_t blocks,
                       const int64_t *dst_off, const int64_t *src_off, const int64_t *len,
                       size_t spans, int streaming)
{
    for (size_t b = 0; b < blocks; b++) {
        char *d = (char *)(uintptr_t)dst_base[b];
        const char *s = (const char *)(uintptr_t)src_base[b];
        for (size_t i = 0; i < spans; i++) {
            if (streaming)
                copy_streaming(d + dst_off[i], s + src_off[i], (size_t)len[i]);
            else
                memcpy(d + dst_off[i], s + src_off[i], (size_t)len[i]);
        }
    }
#if defined(__SSE2__)
    if (streaming)
        _mm_sfence(); /* streaming stores are weakly ordered: visible before the caller signals */
#endif
}

/* kvstage/staging/checksum.py's term sum of `words` 32-bit words from v, the first at key `key`:
 * (v[p] ^ k) * (k | 1), the key a running sum (it vectorizes with no multiply). Inlined into each
 * caller, which is built for AVX2 too where the CPU has it (target_clones): the 32-bit multiply
 * vectorizes there, so a pass runs at memory speed. */
static inline uint32_t checksum_terms(const uint32_t *v, size_t words, uint32_t key)
{
    uint32_t s = 0, k = key;
    for (size_t p = 0; p < words; p++) {
        s += (v[p] ^ k) * (k | 1u);
        k += 0x9E3779B1u;
    }
    return s;
}

/* kvstage/staging/checksum.py's sums: for each of nseg segments of seg_bytes bytes from base
 * (seg_bytes a multiple of 4), the sum over its 32-bit words v[p] of (v[p] ^ key) * (key | 1),
 * key = p * 0x9E3779B1 + 0x7F4A7C15, mod 2^32. */
__attribute__((target_clones("avx2", "default")))
void kvstage_checksum_segments(const char *base, size_t nseg, size_t seg_bytes, uint32_t *out)
{
    const size_t words = seg_bytes / 4;
    for (size_t g = 0; g < nseg; g++) {
        out[g] = checksum_terms((const uint32_t *)(base + g * seg_bytes), words, 0x7F4A7C15u);
    }
}

/* Where a span lies in the region's segments: the segment and the offset in it of region offset
 * `rel`. Spans come mostly in region order, one after another: the previous span's end (`next`) is
 * then reused, with no division (a 64-bit one per span was most of a pass over a head's rows). */
typedef struct { uint64_t next; size_t seg, in_seg; } SegmentAt;

static inline void segment_at(SegmentAt *at, uint64_t rel, size_t seg_bytes)
{
    if (rel != at->next) {
        at->seg = (size_t)(rel / seg_bytes);
        at->in_seg = (size_t)(rel - (uint64_t)at->seg * seg_bytes);
    }
}

/* Copy (copy != 0) and sum one span of n bytes from sp at region offset rel, in pieces of at most
 * CHECKSUM_STEP bytes, each summed right after it is copied, from the copy's source while it is
 * still in the cache: the bytes are read from memory once. */
#define CHECKSUM_STEP 4096
static inline void span_sum(SegmentAt *at, char *dp, const char *sp, size_t n, uint64_t rel, size_t seg_bytes,
                            int copy, int streaming, uint32_t *sums)
{
    segment_at(at, rel, seg_bytes);
    while (n) {
        size_t m = seg_bytes - at->in_seg;
        if (m > n)
            m = n;
        if (m > CHECKSUM_STEP)
            m = CHECKSUM_STEP;
        if (copy) {
            if (streaming)
                copy_streaming(dp, sp, m);
            else
                memcpy(dp, sp, m);
            dp += m;
        }
        const uint32_t key = (uint32_t)(at->in_seg / 4) * 0x9E3779B1u + 0x7F4A7C15u;
        sums[at->seg] += checksum_terms((const uint32_t *)sp, m / 4, key);
        sp += m, n -= m, rel += m;
        at->in_seg += m;
        if (at->in_seg == seg_bytes)
            at->seg++, at->in_seg = 0;
    }
    at->next = rel;
}

/* kvstage_copy_spans, and each copied byte's term of kvstage/staging/checksum.py's sum added to its
 * segment's: the region side of the copy (the destination for a gather, region_is_dst, else the
 * source) is cut into segments of seg_bytes from origin, and a word's key is its position in its
 * segment. Lengths and offsets are multiples of 4 (whole words). Each segment's sum is written by one
 * caller only (a host scatter shares its buffers among threads; segments do not span buffers). */
__attribute__((target_clones("avx2", "default")))
void kvstage_copy_spans_sum(const uint64_t *dst_base, const uint64_t *src_base, size_t blocks,
                           const int64_t *dst_off, const int64_t *src_off, const int64_t *len,
                           size_t spans, int streaming, int region_is_dst, uint64_t origin, size_t seg_bytes,
                           uint32_t *sums)
{
    for (size_t b = 0; b < blocks; b++) {
        char *d = (char *)(uintptr_t)dst_base[b];
        const char *s = (const char *)(uintptr_t)src_base[b];
        SegmentAt at = {UINT64_MAX, 0, 0};
        for (size_t i = 0; i < spans; i++) {
            char *dp = d + dst_off[i];
            const char *sp = s + src_off[i];
            const uint64_t place = region_is_dst ? (uint64_t)(uintptr_t)dp : (uint64_t)(uintptr_t)sp;
            span_sum(&at, dp, sp, (size_t)len[i], place - origin, seg_bytes, 1, streaming, sums);
        }
    }
#if defined(__SSE2__)
    if (streaming)
        _mm_sfence();
#endif
}

/* kvstage_copy_spans_sum's sums with no copy: the spans are read from src_base's buffers only, and
 * at_base/at_off place each span in a region that is never touched (its segments of seg_bytes from
 * origin give each word's key). The ipc, direct and pages paths sum a request's pages this way on
 * both sides, as a gather of them would. */
__attribute__((target_clones("avx2", "default")))
void kvstage_sum_spans(const uint64_t *at_base, const uint64_t *src_base, size_t blocks,
                       const int64_t *at_off, const int64_t *src_off, const int64_t *len,
                       size_t spans, uint64_t origin, size_t seg_bytes, uint32_t *sums)
{
    for (size_t b = 0; b < blocks; b++) {
        const char *s = (const char *)(uintptr_t)src_base[b];
        SegmentAt at = {UINT64_MAX, 0, 0};
        for (size_t i = 0; i < spans; i++) {
            const uint64_t place = at_base[b] + (uint64_t)at_off[i];
            span_sum(&at, NULL, s + src_off[i], (size_t)len[i], place - origin, seg_bytes, 0, 0, sums);
        }
    }
}
