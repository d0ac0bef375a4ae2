/* See feed_text.h. */
#include "feed_text.h"

#include <math.h>
#include <string.h>

long ft_int_array(const int64_t *v, size_t n, int64_t high, char *out, size_t room)
{
    if (n > (SIZE_MAX - 2) / (FT_DIGITS + 1) || room < 2 + n * (FT_DIGITS + 1))
        return FT_NO_ROOM;
    size_t at = 0;
    out[at++] = '[';
    for (size_t i = 0; i < n; i++) {
        int64_t x = v[i];
        if (x < 0 || x > high)
            return FT_BAD_VALUE;
        if (i)
            out[at++] = ',';
        char digits[FT_DIGITS];
        size_t k = 0;
        uint64_t u = (uint64_t)x;
        do {
            digits[k++] = (char)('0' + u % 10);
            u /= 10;
        } while (u);
        while (k)
            out[at++] = digits[--k];
    }
    out[at++] = ']';
    return (long)at;
}

long ft_ages_ms(double now, const double *last, size_t n, int64_t high_ms, int64_t *ms)
{
    if (!isfinite(now))
        return FT_BAD_VALUE;
    double high = (double)high_ms;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(last[i]))
            return FT_BAD_VALUE;
        /* The same double arithmetic as Python's (now - t) * 1000.0, then the same rounding. */
        double x = (now - last[i]) * 1000.0;
        double r = nearbyint(x); /* the default rounding mode: to nearest, ties to even */
        if (!(r > 0.0))
            ms[i] = 0;
        else if (r >= high)
            ms[i] = high_ms;
        else
            ms[i] = (int64_t)r;
    }
    return 0;
}
