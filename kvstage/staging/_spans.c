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
