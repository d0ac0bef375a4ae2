/* The splice pump: moves bytes both ways between connection pairs with splice(2), in its own threads.
 *
 * Python hands over a (gateway fd, sandbox fd) pair once; from then on the pump owns both descriptors
 * and does every read, write, half-close, reset and (on a kernel-TLS gateway socket) control record
 * itself. Python reads exact per-connection counters whenever it likes and learns of each finished
 * connection through an eventfd plus sp_take_events(). No Python code runs per chunk.
 *
 * native/build_splice.py gives cffi this header (past the includes, comments dropped) as its cdef:
 * keep it to plain integer #defines, structs and prototypes. */
#ifndef SBXNET_SPLICE_PUMP_H
#define SBXNET_SPLICE_PUMP_H

#include <stdint.h>

/* Flags for sp_add(). */
#define SP_GW_KTLS 0x1u /* the gateway fd has kernel TLS TX and RX installed */

/* The smallest pipe a kernel-TLS connection is taken with, in bytes. A read from a kTLS socket must
 * fit a whole record in the pipe (16 KiB of plaintext, which may span five pages when it does not start
 * on one; read_record writes up to 16 KiB + 256 in one write), and pipe sizes are powers of two pages.
 * Linux gives an unprivileged user's pipes two pages (8 KiB) once fs/pipe-user-pages-soft is reached
 * and refuses to grow them: sp_add refuses such a connection with -ENOBUFS rather than cut a record. */
#define SP_KTLS_MIN_PIPE 32768

/* Outcomes (sp_event.outcome); forwarder/ingress/planes/splice_pump.py names them. */
#define SP_OUT_CLOSED 0        /* both directions ended with an orderly end of stream */
#define SP_OUT_RESET_GATEWAY 1 /* the gateway side reset, failed or (kTLS) ended without close_notify;
                                * the sandbox was reset */
#define SP_OUT_RESET_SANDBOX 2 /* the sandbox side reset or failed; the gateway was reset */
#define SP_OUT_CLOSE_TIMEOUT 3 /* one direction ended, the other did not within the close timeout */
#define SP_OUT_TLS_ERROR 4     /* a record failed to decrypt, or a TLS record we refuse */
#define SP_OUT_ABORTED 5       /* sp_abort() or sp_free() */
#define SP_OUT_INTERNAL 6      /* a local error (pipe, epoll) */

/* Reasons (sp_event.reason): finer than the outcome, stable tokens in Python. */
#define SP_R_NONE 0
#define SP_R_EOF 1              /* both directions ended */
#define SP_R_RESET 2            /* ECONNRESET / EPIPE / socket error on that side; or (err 0, flag
                                 * SP_EV_GW_FIN) a kTLS gateway's FIN with no close_notify before it */
#define SP_R_TIMEOUT 3
#define SP_R_TLS_DECRYPT 4      /* EBADMSG: a record failed authentication */
#define SP_R_TLS_KEY_UPDATE 5   /* a KeyUpdate handshake message from the gateway */
#define SP_R_TLS_ALERT 6        /* an alert other than close_notify */
#define SP_R_TLS_UNEXPECTED 7   /* any other non-data record */
#define SP_R_TLS_RECORD 8       /* the kernel refused the record (EMSGSIZE, EINVAL on recvmsg) */
#define SP_R_ABORT 9
#define SP_R_ABORT_RESET 10
#define SP_R_INTERNAL 11

struct sp_event {
    uint64_t id;
    uint64_t bytes_up;   /* gateway -> sandbox, delivered to the sandbox socket */
    uint64_t bytes_down; /* sandbox -> gateway, delivered to the gateway socket */
    int32_t outcome;
    int32_t reason;
    int32_t err;         /* errno behind the reason, 0 if none */
    uint32_t flags;      /* SP_EV_* */
};

#define SP_EV_GW_CLOSE_NOTIFY 0x1u /* the gateway ended its direction with close_notify */
#define SP_EV_GW_FIN 0x2u          /* the gateway's TCP stream ended with no close_notify: on plain TCP
                                    * its orderly end; on kTLS a truncation, reset (SP_OUT_RESET_GATEWAY) */
#define SP_EV_SB_EOF 0x4u          /* the sandbox ended its direction */
#define SP_EV_SENT_CLOSE_NOTIFY 0x8u

struct sp_moved {
    uint64_t id;
    uint64_t bytes_up;
    uint64_t bytes_down;
};

struct sp_stats {
    uint64_t added;
    uint64_t finished;
    uint64_t active;
    uint64_t bytes_up;   /* finished + live connections */
    uint64_t bytes_down;
    uint64_t splice_calls;
    uint64_t control_records; /* non-data records read with recvmsg on kTLS sockets */
};

/* A connection taken out of a pump by sp_detach(), for sp_adopt() into another (in another process:
 * the six descriptors go over SCM_RIGHTS) or back into this one. The pipes move with it, so the bytes
 * in them are neither lost nor sent twice: the adopting pump writes out pipe_bytes before it reads
 * into a pipe again, as this one would have. */
struct sp_detached {
    int32_t gw_fd, sb_fd;
    int32_t up_pr, up_pw;     /* gateway -> sandbox pipe: read end, write end */
    int32_t down_pr, down_pw; /* sandbox -> gateway */
    uint32_t up_pipe_bytes, down_pipe_bytes;
    uint32_t flags;           /* SP_GW_* given to sp_add */
    uint32_t evflags;         /* SP_EV_* so far */
    uint32_t close_timeout_ms;
    int32_t close_left_ms;    /* -1: no direction has ended; else what is left of the close timeout */
    uint32_t dir_state;       /* SP_DS_* bits */
    uint64_t bytes_up, bytes_down; /* delivered so far; an adopted connection's counters go on from these */
};

#define SP_DS_UP_IN_EOF 0x1u
#define SP_DS_UP_OUT_SHUT 0x2u
#define SP_DS_DOWN_IN_EOF 0x4u
#define SP_DS_DOWN_OUT_SHUT 0x8u

typedef struct sp_pump sp_pump;

/* threads >= 1, max_conns >= 1, pipe_size in bytes (0 = the kernel's default, 64 KiB): each pipe is
 * set to it, larger or smaller than the default; what the kernel really gave is what the pump uses.
 * On failure returns NULL and writes a message into errbuf. */
sp_pump *sp_new(int threads, int max_conns, int pipe_size, char *errbuf, int errlen);
/* Readable (eventfd semantics) whenever events are waiting. */
int sp_event_fd(sp_pump *p);
/* Takes ownership of both fds (non-blocking, connected) on success: returns an id >= 0. On failure
 * returns -errno and the caller still owns the fds: -ENOBUFS when SP_GW_KTLS is set and a pipe holds
 * less than SP_KTLS_MIN_PIPE (the kernel gave a smaller one than pipe_size asked for), -ENOSPC when
 * max_conns are live. close_timeout_ms applies once one direction ended. */
int64_t sp_add(sp_pump *p, int gw_fd, int sb_fd, uint32_t flags, uint32_t close_timeout_ms);
/* Exact counters of a live connection: 0, or -ENOENT once it finished (its event carries the totals). */
int sp_counters(sp_pump *p, uint64_t id, uint64_t *up, uint64_t *down);
/* The live connections whose counters changed since the last call that reported them (each one's
 * first report once it has moved a byte), walking the slots from *cursor: up to max written to out,
 * *cursor left after the last slot looked at (max_conns once the walk is done; start again from 0).
 * One lock for the walk and a few nanoseconds a slot, so an idle connection costs its meter nothing. */
int sp_take_moved(sp_pump *p, struct sp_moved *out, int max, uint32_t *cursor);
/* Copies up to max finished-connection events, oldest first; returns how many. */
int sp_take_events(sp_pump *p, struct sp_event *out, int max);
/* Asks the owning thread to end a connection (reset != 0: with a TCP reset both ways). 0 or -ENOENT. */
int sp_abort(sp_pump *p, uint64_t id, int reset);
void sp_get_stats(sp_pump *p, struct sp_stats *out);
/* Takes a live connection out of the pump without closing or moving anything more: its owning thread
 * stops watching it, and *out receives its descriptors (the caller's from now on) and its state. Waits
 * for that thread. A paused one (sp_adopt) is handed back as it was adopted. 0, or -ENOENT if it is
 * unknown or finished first (its event comes as usual). */
int sp_detach(sp_pump *p, uint64_t id, struct sp_detached *out);
/* Takes over a detached connection (descriptors owned by the pump on success, as with sp_add): returns
 * its new id, or -errno (EINVAL: a descriptor missing or blocking, or a state it cannot be in). With
 * paused != 0 nothing is read or written until sp_resume(); sp_counters reports it meanwhile. */
int64_t sp_adopt(sp_pump *p, const struct sp_detached *d, int paused);
/* Starts a paused adopted connection. 0, or -ENOENT. */
int sp_resume(sp_pump *p, uint64_t id);
/* Stops the threads and closes every descriptor still owned (no events for those). */
void sp_free(sp_pump *p);

#endif
