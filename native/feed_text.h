/* The idle feed's number columns as JSON text, and its ages in milliseconds (sbxnet/protocol/feed.py,
 * the column form of a batch; forwarder/ingress/feed_outbox.py). 10,000 sandboxes a second make these
 * loops the largest part of the feed's CPU in Python; here each value is a few nanoseconds.
 *
 * Pure: caller-owned arrays in, caller-owned buffers out, nothing allocated, no state. Each function has
 * a pure-Python reference in sbxnet/protocol/feed.py (_int_array_py, _ages_ms_py) that the tests and
 * tests/fuzz/fuzz_feed_text.py compare it against.
 *
 * native/build_feed_text.py gives cffi this header (past the includes, comments dropped) as its cdef:
 * keep it to plain integer #defines and prototypes. */
#ifndef SBXNET_FEED_TEXT_H
#define SBXNET_FEED_TEXT_H

#include <stddef.h>
#include <stdint.h>

#define FT_BAD_VALUE -1 /* a value out of [0, high] (ft_int_array), a time not finite (ft_ages_ms) */
#define FT_NO_ROOM -2   /* out is shorter than FT_ROOM(n) bytes */
#define FT_DIGITS 19    /* the most digits of an int64_t at or above 0 */

/* Writes v[0..n) into out as a JSON array of decimal integers, "[1,20,3]" ("[]" for n == 0), and returns
 * how many bytes it wrote; FT_BAD_VALUE if a value is below 0 or above high (out is then undefined);
 * FT_NO_ROOM if room is below 2 + n * (FT_DIGITS + 1), which always suffices. */
long ft_int_array(const int64_t *v, size_t n, int64_t high, char *out, size_t room);

/* ms[i] = the age of last[i] at now in milliseconds: (now - last[i]) * 1000 rounded to the nearest
 * integer, ties to even (Python's round()), 0 for a time ahead of now, high_ms for one older than that.
 * Returns 0, or FT_BAD_VALUE if now or a last[i] is not finite (ms then undefined). high_ms must be below
 * 2**53 (exact as a double). */
long ft_ages_ms(double now, const double *last, size_t n, int64_t high_ms, int64_t *ms);

#endif
