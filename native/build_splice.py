"""cffi build for ``native._splice``: the splice pump (native/splice_pump.c)."""


from cffi import FFI

ffibuilder = FFI()
ffibuilder.cdef(
    """
    #define SP_GW_KTLS 1
    struct sp_event {
        uint64_t id;
        uint64_t bytes_up;
        uint64_t bytes_down;
        int32_t outcome;
        int32_t reason;
        int32_t err;
        uint32_t flags;
    };
    struct sp_stats {
        uint64_t added;
        uint64_t finished;
        uint64_t active;
        uint64_t bytes_up;
        uint64_t bytes_down;
        uint64_t splice_calls;
        uint64_t control_records;
    };
    typedef struct sp_pump sp_pump;
    sp_pump *sp_new(int threads, int max_conns, int pipe_size, char *errbuf, int errlen);
    int sp_event_fd(sp_pump *p);
    int64_t sp_add(sp_pump *p, int gw_fd, int sb_fd, uint32_t flags, uint32_t close_timeout_ms);
    int sp_counters(sp_pump *p, uint64_t id, uint64_t *up, uint64_t *down);
    int sp_take_events(sp_pump *p, struct sp_event *out, int max);
    int sp_abort(sp_pump *p, uint64_t id, int reset);
    void sp_get_stats(sp_pump *p, struct sp_stats *out);
    void sp_free(sp_pump *p);
    """
)
ffibuilder.set_source(
    "native._splice",
    '#include "splice_pump.h"',
    sources=["native/splice_pump.c"],
    include_dirs=["native"],
    depends=["native/splice_pump.h"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
