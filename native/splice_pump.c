/* The splice pump: see splice_pump.h for the contract.
 *
 * Threads: each worker owns an epoll set and the connections assigned to it; only that worker reads,
 * writes, or closes their descriptors. The Python thread only allocates a slot, hands the connection to
 * a worker's inbox, reads atomic counters, and collects events. A finished connection's slot goes back
 * to the free list only when its event has been taken, so the event queue can never overflow and a
 * stale epoll event can never reach a slot that was reused.
 *
 * Per direction: in_fd -> pipe -> out_fd with splice(2). The pipe is drained before the next read, so a
 * direction whose writer is blocked stops reading (back-pressure reaches the sender through TCP), and a
 * read from a kernel-TLS socket always finds an empty pipe: Linux 6.1's tls_sw_splice_read drops the
 * rest of a record that did not fit the pipe, so a record must never meet a partly full one. */
#define _GNU_SOURCE
#include "splice_pump.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/tls.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef SOL_TLS
#define SOL_TLS 282
#endif

#define TLS_CT_ALERT 21
#define TLS_CT_HANDSHAKE 22
#define TLS_CT_APPLICATION_DATA 23
#define TLS_HS_KEY_UPDATE 24
#define TLS_ALERT_CLOSE_NOTIFY 0

#define SPLICE_BUDGET 64 /* splice calls per direction before yielding to other connections */
#define TIMER_TICK_MS 50
#define MAX_EVENTS 128
#define WAKE_TAG UINT64_MAX
#define CONTROL_BUF (16384 + 256)

/* ST_PAUSED: adopted, not yet resumed (no thread has it). ST_DETACHED: out of its thread, its slot
 * waiting for sp_detach's caller to copy the state out. */
enum { ST_FREE = 0, ST_PENDING, ST_LIVE, ST_DONE, ST_PAUSED, ST_DETACHED };
enum { DET_NONE = 0, DET_DONE, DET_GONE };
enum { DIR_WAIT = 0, DIR_BUDGET, DIR_FAIL };

struct dir {
    int in_fd, out_fd;
    int pr, pw; /* pipe read / write ends */
    uint32_t pipe_bytes;
    uint32_t cap; /* the pipe's real capacity: what one read may ask for */
    uint8_t in_eof, out_shut, in_ktls, out_ktls;
    uint64_t bytes; /* atomic: delivered to out_fd */
};

struct worker;

struct conn {
    uint32_t gen;
    uint32_t slot;
    int state; /* atomic */
    int abort_req; /* atomic: 0, 1 = close, 2 = reset */
    int detach_req; /* atomic: sp_detach waits for this connection */
    int detach_state; /* DET_*, under p->mu */
    int32_t adopt_left_ms; /* adopted with a running close timer: arm it with this much left */
    struct sp_detached det;
    struct worker *w;
    int gw, sb;
    uint32_t flags;
    uint32_t close_timeout_ms;
    uint32_t evflags;
    int64_t deadline_ms;
    struct dir up, down;
    uint64_t moved_up, moved_down; /* the counters sp_take_moved last reported, under p->mu */
    struct sp_event ev;
    struct conn *next, *prev;          /* worker's live list */
    struct conn *tnext, *tprev;        /* worker's timer list */
    struct conn *inbox_next, *ready_next, *done_next, *det_next;
    uint8_t in_timer, in_ready;
};

struct worker {
    sp_pump *p;
    pthread_t th;
    int started;
    int epfd;
    int wakefd;
    pthread_mutex_t inbox_mu;
    struct conn *inbox;
    int abort_pending; /* atomic */
    struct conn *live;
    struct conn *timers;
    struct conn *ready;
    struct conn *done;
    struct conn *detached;
    int64_t next_tick;
};

struct sp_pump {
    int nthreads;
    int max_conns;
    int pipe_size;
    int evfd;
    int stop; /* atomic */
    struct worker *workers;
    struct conn *conns;
    pthread_mutex_t mu; /* free list, event queue, stats, detach states */
    pthread_cond_t detach_cv; /* a detach finished (under mu) */
    uint32_t *free_slots;
    int nfree;
    uint32_t *evq; /* ring of slots whose event is ready */
    int evq_head, evq_len;
    uint32_t rr;
    struct sp_stats st; /* added / finished / bytes of finished connections, under mu */
    uint64_t splice_calls;    /* atomic */
    uint64_t control_records; /* atomic */
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void wake(int fd)
{
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof one);
    (void)r; /* EAGAIN means the counter is already non-zero: the reader wakes anyway */
}

static void set_linger0(int fd)
{
    struct linger lg = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
}

/* ---- worker-local lists ---- */

static void live_link(struct worker *w, struct conn *c)
{
    c->prev = NULL;
    c->next = w->live;
    if (w->live)
        w->live->prev = c;
    w->live = c;
}

static void live_unlink(struct worker *w, struct conn *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        w->live = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->next = c->prev = NULL;
}

static void timer_arm(struct worker *w, struct conn *c)
{
    if (c->in_timer)
        return;
    c->deadline_ms = now_ms() + c->close_timeout_ms;
    c->in_timer = 1;
    c->tprev = NULL;
    c->tnext = w->timers;
    if (w->timers)
        w->timers->tprev = c;
    w->timers = c;
}

static void timer_disarm(struct worker *w, struct conn *c)
{
    if (!c->in_timer)
        return;
    if (c->tprev)
        c->tprev->tnext = c->tnext;
    else
        w->timers = c->tnext;
    if (c->tnext)
        c->tnext->tprev = c->tprev;
    c->tnext = c->tprev = NULL;
    c->in_timer = 0;
}

/* ---- finishing ---- */

static void close_dir_pipes(struct dir *d)
{
    if (d->pr >= 0)
        close(d->pr);
    if (d->pw >= 0)
        close(d->pw);
    d->pr = d->pw = -1;
}

/* Ends a connection: releases its descriptors and queues its event for publication after the batch. */
static void conn_finish(struct worker *w, struct conn *c, int outcome, int reason, int err, int rst_gw,
                        int rst_sb)
{
    if (__atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != ST_LIVE)
        return;
    epoll_ctl(w->epfd, EPOLL_CTL_DEL, c->gw, NULL);
    epoll_ctl(w->epfd, EPOLL_CTL_DEL, c->sb, NULL);
    if (rst_gw)
        set_linger0(c->gw);
    if (rst_sb)
        set_linger0(c->sb);
    close(c->gw);
    close(c->sb);
    c->gw = c->sb = -1;
    close_dir_pipes(&c->up);
    close_dir_pipes(&c->down);
    timer_disarm(w, c);
    live_unlink(w, c);
    c->ev.outcome = outcome;
    c->ev.reason = reason;
    c->ev.err = err;
    c->ev.flags = c->evflags;
    c->ev.bytes_up = __atomic_load_n(&c->up.bytes, __ATOMIC_RELAXED);
    c->ev.bytes_down = __atomic_load_n(&c->down.bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&c->state, ST_DONE, __ATOMIC_RELEASE);
    c->done_next = w->done;
    w->done = c;
}

static void publish_done(struct worker *w)
{
    sp_pump *p = w->p;
    if (!w->done)
        return;
    pthread_mutex_lock(&p->mu);
    int gone = 0;
    for (struct conn *c = w->done; c; c = c->done_next) {
        if (__atomic_load_n(&c->detach_req, __ATOMIC_ACQUIRE)) {
            c->detach_state = DET_GONE; /* finished before its detach: the event tells the rest */
            gone = 1;
        }
        int tail = (p->evq_head + p->evq_len) % p->max_conns;
        p->evq[tail] = c->slot;
        p->evq_len++;
        p->st.finished++;
        p->st.bytes_up += c->ev.bytes_up;
        p->st.bytes_down += c->ev.bytes_down;
    }
    if (gone)
        pthread_cond_broadcast(&p->detach_cv);
    pthread_mutex_unlock(&p->mu);
    w->done = NULL;
    wake(p->evfd);
}

/* Detached connections are handed to their waiters only after the batch: until then an epoll event or
 * the ready list of this batch may still name the slot, and the waiter frees it. */
static void publish_detached(struct worker *w)
{
    sp_pump *p = w->p;
    if (!w->detached)
        return;
    pthread_mutex_lock(&p->mu);
    for (struct conn *c = w->detached; c; c = c->det_next) {
        __atomic_store_n(&c->state, ST_DETACHED, __ATOMIC_RELEASE);
        c->detach_state = DET_DONE;
    }
    pthread_cond_broadcast(&p->detach_cv);
    pthread_mutex_unlock(&p->mu);
    w->detached = NULL;
}

/* Out of this thread, nothing closed: the descriptors and the state go to sp_detach's caller. */
static void conn_detach(struct worker *w, struct conn *c)
{
    epoll_ctl(w->epfd, EPOLL_CTL_DEL, c->gw, NULL);
    epoll_ctl(w->epfd, EPOLL_CTL_DEL, c->sb, NULL);
    struct sp_detached *d = &c->det;
    memset(d, 0, sizeof *d);
    d->gw_fd = c->gw;
    d->sb_fd = c->sb;
    d->up_pr = c->up.pr;
    d->up_pw = c->up.pw;
    d->down_pr = c->down.pr;
    d->down_pw = c->down.pw;
    d->up_pipe_bytes = c->up.pipe_bytes;
    d->down_pipe_bytes = c->down.pipe_bytes;
    d->flags = c->flags;
    d->evflags = c->evflags;
    d->close_timeout_ms = c->close_timeout_ms;
    d->close_left_ms = -1;
    if (c->in_timer) {
        int64_t left = c->deadline_ms - now_ms();
        d->close_left_ms = left > 0 ? (int32_t)left : 0;
    }
    d->dir_state = (c->up.in_eof ? SP_DS_UP_IN_EOF : 0) | (c->up.out_shut ? SP_DS_UP_OUT_SHUT : 0) |
                   (c->down.in_eof ? SP_DS_DOWN_IN_EOF : 0) | (c->down.out_shut ? SP_DS_DOWN_OUT_SHUT : 0);
    d->bytes_up = __atomic_load_n(&c->up.bytes, __ATOMIC_RELAXED);
    d->bytes_down = __atomic_load_n(&c->down.bytes, __ATOMIC_RELAXED);
    c->gw = c->sb = -1;
    c->up.pr = c->up.pw = c->down.pr = c->down.pw = -1;
    timer_disarm(w, c);
    live_unlink(w, c);
    __atomic_store_n(&c->state, ST_DONE, __ATOMIC_RELEASE); /* not live: this batch skips it */
    c->det_next = w->detached;
    w->detached = c;
}

/* ---- kernel TLS control records ---- */

/* Sends close_notify as an alert record through kernel TLS TX. 0, or -errno. */
static int send_close_notify(int fd)
{
    unsigned char alert[2] = {1, TLS_ALERT_CLOSE_NOTIFY}; /* level warning, close_notify */
    union {
        char buf[CMSG_SPACE(sizeof(unsigned char))];
        struct cmsghdr align;
    } u;
    struct iovec iov = {alert, sizeof alert};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    memset(&u, 0, sizeof u);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = u.buf;
    msg.msg_controllen = sizeof u.buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_TLS;
    cm->cmsg_type = TLS_SET_RECORD_TYPE;
    cm->cmsg_len = CMSG_LEN(sizeof(unsigned char));
    *CMSG_DATA(cm) = TLS_CT_ALERT;
    for (;;) {
        ssize_t n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n == (ssize_t)sizeof alert)
            return 0;
        if (n < 0 && errno == EINTR)
            continue;
        return n < 0 ? -errno : -EIO;
    }
}

enum { CTL_DATA = 0, CTL_CLOSE_NOTIFY, CTL_FIN, CTL_WAIT, CTL_FAIL };

/* Reads the gateway's next record(s) with recvmsg where splice(2) cannot say what it met: EINVAL (a
 * record that is not data) or 0 (the end of the stream, or a record with no data: TLS 1.3 allows
 * empty and padding-only records, and splice returns 0 for those too). recvmsg tells them apart: 0
 * with no record type is the end of the stream. Data it returns (it may take the records after an
 * empty one) goes into the direction's pipe, which is empty at every read and holds a whole buffer. */
static int read_record(sp_pump *p, struct conn *c, struct dir *d, int *reason, int *err)
{
    unsigned char buf[CONTROL_BUF];
    union {
        char b[CMSG_SPACE(sizeof(unsigned char))];
        struct cmsghdr align;
    } u;
    struct iovec iov = {buf, sizeof buf};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = u.b;
    msg.msg_controllen = sizeof u.b;
    ssize_t n;
    do {
        n = recvmsg(c->gw, &msg, MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
        if (errno == EAGAIN)
            return CTL_WAIT;
        *err = errno;
        *reason = errno == EBADMSG ? SP_R_TLS_DECRYPT : SP_R_TLS_RECORD;
        return CTL_FAIL;
    }
    int type = -1;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
        if (cm->cmsg_level == SOL_TLS && cm->cmsg_type == TLS_GET_RECORD_TYPE &&
            cm->cmsg_len >= CMSG_LEN(sizeof(unsigned char)))
            type = *CMSG_DATA(cm);
    *err = 0;
    if (type < 0) {
        if (n == 0)
            return CTL_FIN; /* the TCP stream ended, and no close_notify came before it */
        *reason = SP_R_TLS_RECORD; /* bytes without a record type: not what kernel TLS returns */
        return CTL_FAIL;
    }
    if (type == TLS_CT_APPLICATION_DATA) {
        /* n == 0: empty records, consumed; what follows them is for the next read to find. */
        if (n > 0) {
            ssize_t w;
            do {
                w = write(d->pw, buf, (size_t)n);
            } while (w < 0 && errno == EINTR);
            if (w != n) {
                *err = w < 0 ? errno : EIO;
                *reason = SP_R_INTERNAL;
                return CTL_FAIL;
            }
            d->pipe_bytes += (uint32_t)n;
        }
        return CTL_DATA;
    }
    __atomic_add_fetch(&p->control_records, 1, __ATOMIC_RELAXED);
    if (type == TLS_CT_ALERT && n >= 2 && buf[1] == TLS_ALERT_CLOSE_NOTIFY) {
        c->evflags |= SP_EV_GW_CLOSE_NOTIFY;
        return CTL_CLOSE_NOTIFY;
    }
    if (type == TLS_CT_ALERT)
        *reason = SP_R_TLS_ALERT;
    else if (type == TLS_CT_HANDSHAKE && n >= 1 && buf[0] == TLS_HS_KEY_UPDATE)
        *reason = SP_R_TLS_KEY_UPDATE;
    else
        *reason = SP_R_TLS_UNEXPECTED;
    return CTL_FAIL;
}

/* ---- moving bytes ---- */

struct fail {
    int outcome, reason, err, rst_gw, rst_sb;
};

static void fail_side(struct conn *c, int fd, int err, struct fail *f)
{
    int gw_side = fd == c->gw;
    f->outcome = gw_side ? SP_OUT_RESET_GATEWAY : SP_OUT_RESET_SANDBOX;
    f->reason = SP_R_RESET;
    f->err = err;
    f->rst_gw = !gw_side;
    f->rst_sb = gw_side;
}

/* A kernel-TLS gateway's TCP stream ended with no close_notify before it: a cut or a truncation, not
 * an orderly end, so it is failed like a reset (both sides reset, the sandbox never sees a clean end
 * of stream). Everything decrypted before it has been delivered: reads only ever meet an empty pipe. */
static void fail_bare_fin(struct conn *c, struct fail *f)
{
    c->evflags |= SP_EV_GW_FIN;
    f->outcome = SP_OUT_RESET_GATEWAY;
    f->reason = SP_R_RESET;
    f->err = 0;
    f->rst_gw = f->rst_sb = 1;
}

static int dir_run(sp_pump *p, struct conn *c, struct dir *d, struct fail *f)
{
    for (int budget = SPLICE_BUDGET; budget > 0; budget--) {
        if (d->pipe_bytes) {
            ssize_t n = splice(d->pr, NULL, d->out_fd, NULL, d->pipe_bytes, SPLICE_F_NONBLOCK | SPLICE_F_MOVE);
            __atomic_add_fetch(&p->splice_calls, 1, __ATOMIC_RELAXED);
            if (n > 0) {
                d->pipe_bytes -= (uint32_t)n;
                __atomic_add_fetch(&d->bytes, (uint64_t)n, __ATOMIC_RELAXED);
                continue;
            }
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0 && errno == EAGAIN)
                return DIR_WAIT;
            fail_side(c, d->out_fd, n < 0 ? errno : EIO, f);
            return DIR_FAIL;
        }
        if (d->in_eof) {
            if (d->out_shut)
                return DIR_WAIT;
            if (d->out_ktls) {
                int r = send_close_notify(d->out_fd);
                if (r == -EAGAIN)
                    return DIR_WAIT;
                if (r < 0) {
                    fail_side(c, d->out_fd, -r, f);
                    return DIR_FAIL;
                }
                c->evflags |= SP_EV_SENT_CLOSE_NOTIFY;
            }
            shutdown(d->out_fd, SHUT_WR);
            d->out_shut = 1;
            return DIR_WAIT;
        }
        ssize_t n = splice(d->in_fd, NULL, d->pw, NULL, (size_t)d->cap, SPLICE_F_NONBLOCK | SPLICE_F_MOVE);
        __atomic_add_fetch(&p->splice_calls, 1, __ATOMIC_RELAXED);
        if (n > 0) {
            d->pipe_bytes += (uint32_t)n;
            continue;
        }
        if (n == 0 && !d->in_ktls) {
            /* Plain TCP has no close_notify: its FIN is the orderly end of that direction. */
            d->in_eof = 1;
            c->evflags |= d->in_fd == c->gw ? SP_EV_GW_FIN : SP_EV_SB_EOF;
            continue;
        }
        int e = n == 0 ? 0 : errno;
        if (e == EINTR)
            continue;
        if (e == EAGAIN)
            return DIR_WAIT;
        if (d->in_ktls && (e == 0 || e == EINVAL)) {
            int reason = 0, err = 0;
            int r = read_record(p, c, d, &reason, &err);
            if (r == CTL_WAIT)
                return DIR_WAIT;
            if (r == CTL_DATA)
                continue;
            if (r == CTL_CLOSE_NOTIFY) {
                d->in_eof = 1; /* the gateway's orderly end: FIN to the sandbox, nothing more read */
                continue;
            }
            if (r == CTL_FIN) {
                fail_bare_fin(c, f);
                return DIR_FAIL;
            }
            f->outcome = reason == SP_R_INTERNAL ? SP_OUT_INTERNAL : SP_OUT_TLS_ERROR;
            f->reason = reason;
            f->err = err;
            /* A KeyUpdate is a legitimate message we do not support: close in order. Anything
             * else means the stream cannot be trusted: reset the sandbox so it never takes a
             * truncated stream for a complete one. */
            f->rst_sb = reason != SP_R_TLS_KEY_UPDATE;
            f->rst_gw = reason != SP_R_TLS_KEY_UPDATE;
            return DIR_FAIL;
        }
        if (d->in_ktls && e == EBADMSG) {
            f->outcome = SP_OUT_TLS_ERROR;
            f->reason = SP_R_TLS_DECRYPT;
            f->err = e;
            f->rst_gw = f->rst_sb = 1;
            return DIR_FAIL;
        }
        fail_side(c, d->in_fd, e, f);
        return DIR_FAIL;
    }
    return DIR_BUDGET;
}

static void conn_run(struct worker *w, struct conn *c)
{
    struct fail f = {0, 0, 0, 0, 0};
    int again = 0;
    struct dir *dirs[2] = {&c->up, &c->down};
    for (int i = 0; i < 2; i++) {
        int r = dir_run(w->p, c, dirs[i], &f);
        if (r == DIR_FAIL) {
            if (f.outcome == SP_OUT_TLS_ERROR && !f.rst_gw && !c->down.out_shut) {
                /* Orderly close toward the gateway: close_notify, best effort. */
                if (send_close_notify(c->gw) == 0)
                    c->evflags |= SP_EV_SENT_CLOSE_NOTIFY;
            }
            conn_finish(w, c, f.outcome, f.reason, f.err, f.rst_gw, f.rst_sb);
            return;
        }
        again |= r == DIR_BUDGET;
    }
    if (c->up.out_shut && c->down.out_shut) {
        conn_finish(w, c, SP_OUT_CLOSED, SP_R_EOF, 0, 0, 0);
        return;
    }
    if (c->up.out_shut || c->down.out_shut)
        timer_arm(w, c);
    if (again && !c->in_ready) {
        c->in_ready = 1;
        c->ready_next = w->ready;
        w->ready = c;
    }
}

/* EPOLLERR on one side: the socket's pending error names it (a reset, typically). */
static void conn_error(struct worker *w, struct conn *c, int fd)
{
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err == 0)
        return;
    struct fail f;
    fail_side(c, fd, err, &f);
    if (fd == c->gw && c->flags & SP_GW_KTLS && err == EBADMSG) {
        f.outcome = SP_OUT_TLS_ERROR;
        f.reason = SP_R_TLS_DECRYPT;
        f.rst_gw = f.rst_sb = 1;
    }
    conn_finish(w, c, f.outcome, f.reason, f.err, f.rst_gw, f.rst_sb);
}

static void take_inbox(struct worker *w)
{
    pthread_mutex_lock(&w->inbox_mu);
    struct conn *c = w->inbox;
    w->inbox = NULL;
    pthread_mutex_unlock(&w->inbox_mu);
    while (c) {
        struct conn *next = c->inbox_next;
        c->inbox_next = NULL;
        __atomic_store_n(&c->state, ST_LIVE, __ATOMIC_RELEASE);
        live_link(w, c);
        if (c->adopt_left_ms >= 0) {
            timer_arm(w, c);
            c->deadline_ms = now_ms() + c->adopt_left_ms;
        }
        struct epoll_event ev;
        memset(&ev, 0, sizeof ev);
        ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
        int ok = 1;
        ev.data.u64 = ((uint64_t)c->gen << 32) | ((uint64_t)c->slot << 1);
        ok &= epoll_ctl(w->epfd, EPOLL_CTL_ADD, c->gw, &ev) == 0;
        ev.data.u64 |= 1;
        ok &= epoll_ctl(w->epfd, EPOLL_CTL_ADD, c->sb, &ev) == 0;
        if (!ok)
            conn_finish(w, c, SP_OUT_INTERNAL, SP_R_INTERNAL, errno, 1, 1);
        else
            conn_run(w, c); /* ET registration reports readiness anyway; this saves a wake-up */
        c = next;
    }
}

static void take_aborts(struct worker *w)
{
    if (!__atomic_exchange_n(&w->abort_pending, 0, __ATOMIC_ACQ_REL))
        return;
    struct conn *c = w->live;
    while (c) {
        struct conn *next = c->next;
        if (__atomic_load_n(&c->detach_req, __ATOMIC_ACQUIRE)) {
            conn_detach(w, c);
            c = next;
            continue;
        }
        int req = __atomic_exchange_n(&c->abort_req, 0, __ATOMIC_ACQ_REL);
        if (req)
            conn_finish(w, c, SP_OUT_ABORTED, req == 2 ? SP_R_ABORT_RESET : SP_R_ABORT, 0, req == 2,
                        req == 2);
        c = next;
    }
}

static void run_timers(struct worker *w)
{
    int64_t now = now_ms();
    if (now < w->next_tick)
        return;
    w->next_tick = now + TIMER_TICK_MS;
    struct conn *c = w->timers;
    while (c) {
        struct conn *next = c->tnext;
        if (now >= c->deadline_ms)
            conn_finish(w, c, SP_OUT_CLOSE_TIMEOUT, SP_R_TIMEOUT, 0, 0, 0);
        c = next;
    }
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    sp_pump *p = w->p;
    struct epoll_event evs[MAX_EVENTS];
    for (;;) {
        int timeout = w->ready ? 0 : w->timers ? TIMER_TICK_MS : -1;
        int n = epoll_wait(w->epfd, evs, MAX_EVENTS, timeout);
        if (n < 0 && errno != EINTR)
            break;
        for (int i = 0; i < n; i++) {
            uint64_t tag = evs[i].data.u64;
            if (tag == WAKE_TAG) {
                uint64_t v;
                ssize_t r = read(w->wakefd, &v, sizeof v);
                (void)r;
                if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE))
                    goto out;
                take_inbox(w);
                take_aborts(w);
                continue;
            }
            uint32_t slot = (uint32_t)(tag & 0xffffffffu) >> 1;
            uint32_t gen = (uint32_t)(tag >> 32);
            if (slot >= (uint32_t)p->max_conns)
                continue;
            struct conn *c = &p->conns[slot];
            if (c->w != w || c->gen != gen || __atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != ST_LIVE)
                continue; /* finished earlier in this batch */
            if (evs[i].events & EPOLLERR) {
                conn_error(w, c, (tag & 1) ? c->sb : c->gw);
                if (__atomic_load_n(&c->state, __ATOMIC_ACQUIRE) != ST_LIVE)
                    continue;
            }
            conn_run(w, c);
        }
        struct conn *r = w->ready;
        w->ready = NULL;
        while (r) {
            struct conn *next = r->ready_next;
            r->in_ready = 0;
            if (__atomic_load_n(&r->state, __ATOMIC_ACQUIRE) == ST_LIVE)
                conn_run(w, r);
            r = next;
        }
        if (w->timers)
            run_timers(w);
        publish_done(w);
        publish_detached(w);
    }
out:
    publish_done(w);
    publish_detached(w);
    return NULL;
}

/* ---- the Python-facing API ---- */

static void fmt_err(char *errbuf, int errlen, const char *what, int err)
{
    if (errbuf && errlen > 0)
        snprintf(errbuf, (size_t)errlen, "%s: %s", what, strerror(err));
}

void sp_free(sp_pump *p)
{
    if (!p)
        return;
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < p->nthreads; i++) {
        struct worker *w = &p->workers[i];
        if (w->started) {
            wake(w->wakefd);
            pthread_join(w->th, NULL);
        }
    }
    for (int i = 0; i < p->max_conns && p->conns; i++) {
        struct conn *c = &p->conns[i];
        int st = c->state;
        if (st == ST_LIVE || st == ST_PENDING || st == ST_PAUSED) {
            set_linger0(c->gw);
            set_linger0(c->sb);
            close(c->gw);
            close(c->sb);
            close_dir_pipes(&c->up);
            close_dir_pipes(&c->down);
        }
    }
    for (int i = 0; i < p->nthreads; i++) {
        struct worker *w = &p->workers[i];
        if (w->epfd >= 0)
            close(w->epfd);
        if (w->wakefd >= 0)
            close(w->wakefd);
        pthread_mutex_destroy(&w->inbox_mu);
    }
    if (p->evfd >= 0)
        close(p->evfd);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->detach_cv);
    free(p->workers);
    free(p->conns);
    free(p->free_slots);
    free(p->evq);
    free(p);
}

sp_pump *sp_new(int threads, int max_conns, int pipe_size, char *errbuf, int errlen)
{
    if (threads < 1 || threads > 256 || max_conns < 1 || max_conns > (1 << 24) || pipe_size < 0) {
        fmt_err(errbuf, errlen, "sp_new", EINVAL);
        return NULL;
    }
    sp_pump *p = calloc(1, sizeof *p);
    if (!p) {
        fmt_err(errbuf, errlen, "sp_new", ENOMEM);
        return NULL;
    }
    p->nthreads = threads;
    p->max_conns = max_conns;
    p->pipe_size = pipe_size ? pipe_size : 65536;
    p->evfd = -1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->detach_cv, NULL);
    p->workers = calloc((size_t)threads, sizeof *p->workers);
    p->conns = calloc((size_t)max_conns, sizeof *p->conns);
    p->free_slots = calloc((size_t)max_conns, sizeof *p->free_slots);
    p->evq = calloc((size_t)max_conns, sizeof *p->evq);
    if (!p->workers || !p->conns || !p->free_slots || !p->evq) {
        fmt_err(errbuf, errlen, "sp_new", ENOMEM);
        p->nthreads = 0;
        sp_free(p);
        return NULL;
    }
    for (int i = 0; i < max_conns; i++) {
        p->conns[i].slot = (uint32_t)i;
        p->conns[i].gw = p->conns[i].sb = -1;
        p->free_slots[i] = (uint32_t)(max_conns - 1 - i);
    }
    p->nfree = max_conns;
    for (int i = 0; i < threads; i++) {
        struct worker *w = &p->workers[i];
        w->p = p;
        w->epfd = w->wakefd = -1;
        pthread_mutex_init(&w->inbox_mu, NULL);
    }
    p->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->evfd < 0) {
        fmt_err(errbuf, errlen, "eventfd", errno);
        sp_free(p);
        return NULL;
    }
    /* Workers take no signals: Python's handlers must run on the main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (int i = 0; i < threads; i++) {
        struct worker *w = &p->workers[i];
        w->epfd = epoll_create1(EPOLL_CLOEXEC);
        w->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        struct epoll_event ev;
        memset(&ev, 0, sizeof ev);
        ev.events = EPOLLIN;
        ev.data.u64 = WAKE_TAG;
        int err = 0;
        if (w->epfd < 0 || w->wakefd < 0 || epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->wakefd, &ev) < 0)
            err = errno;
        else if ((err = pthread_create(&w->th, NULL, worker_main, w)) == 0)
            w->started = 1;
        if (err) {
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            fmt_err(errbuf, errlen, "worker start", err);
            sp_free(p);
            return NULL;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return p;
}

int sp_event_fd(sp_pump *p)
{
    return p->evfd;
}

/* A non-blocking pipe of (if the kernel allows) size bytes; returns its real capacity, or -errno. Past
 * fs/pipe-user-pages-soft the kernel gives an unprivileged user smaller pipes and refuses F_SETPIPE_SZ:
 * the capacity returned is then what it gave, and sp_add judges it. */
static int make_pipe(struct dir *d, int size)
{
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) < 0)
        return -errno;
    d->pr = fds[0];
    d->pw = fds[1];
    int got = fcntl(d->pw, F_GETPIPE_SZ);
    if (got > 0 && got != size)
        fcntl(d->pw, F_SETPIPE_SZ, size); /* refused past the limits: got stays what it was */
    got = fcntl(d->pw, F_GETPIPE_SZ);
    return got > 0 ? got : -errno;
}

static struct conn *lookup(sp_pump *p, uint64_t id);

/* A free slot, re-initialised under the lock (sp_counters/sp_abort may be looking at it with a stale
 * id), assigned to the next thread; NULL when max_conns are live. */
static struct conn *take_slot(sp_pump *p)
{
    pthread_mutex_lock(&p->mu);
    if (p->nfree == 0) {
        pthread_mutex_unlock(&p->mu);
        return NULL;
    }
    uint32_t slot = p->free_slots[--p->nfree];
    uint32_t w_idx = p->rr++ % (uint32_t)p->nthreads;
    struct conn *c = &p->conns[slot];
    uint32_t gen = c->gen + 1;
    memset(c, 0, sizeof *c);
    c->slot = slot;
    c->gen = gen;
    pthread_mutex_unlock(&p->mu);
    c->w = &p->workers[w_idx];
    c->adopt_left_ms = -1;
    c->ev.id = ((uint64_t)gen << 32) | slot;
    return c;
}

static void give_back_slot(sp_pump *p, struct conn *c)
{
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&c->state, ST_FREE, __ATOMIC_RELEASE);
    p->free_slots[p->nfree++] = c->slot;
    pthread_mutex_unlock(&p->mu);
}

/* Hands a prepared connection to its thread. */
static void enqueue(sp_pump *p, struct conn *c)
{
    __atomic_store_n(&c->state, ST_PENDING, __ATOMIC_RELEASE);
    struct worker *w = c->w;
    pthread_mutex_lock(&w->inbox_mu);
    c->inbox_next = w->inbox;
    w->inbox = c;
    pthread_mutex_unlock(&w->inbox_mu);
    wake(w->wakefd);
    (void)p;
}

static int check_nonblocking(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -errno;
    return fl & O_NONBLOCK ? 0 : -EINVAL;
}

int64_t sp_add(sp_pump *p, int gw_fd, int sb_fd, uint32_t flags, uint32_t close_timeout_ms)
{
    if (gw_fd < 0 || sb_fd < 0 || gw_fd == sb_fd || (flags & ~SP_GW_KTLS))
        return -EINVAL;
    for (int i = 0; i < 2; i++) {
        int r = check_nonblocking(i ? sb_fd : gw_fd);
        if (r < 0)
            return r;
    }
    struct conn *c = take_slot(p);
    if (!c)
        return -ENOSPC;
    c->gw = gw_fd;
    c->sb = sb_fd;
    c->flags = flags;
    c->close_timeout_ms = close_timeout_ms;
    c->up.pr = c->up.pw = c->down.pr = c->down.pw = -1;
    int r1 = make_pipe(&c->up, p->pipe_size);
    int r2 = r1 < 0 ? r1 : make_pipe(&c->down, p->pipe_size);
    c->up.cap = r1 > 0 ? (uint32_t)r1 : 0;
    c->down.cap = r2 > 0 ? (uint32_t)r2 : 0;
    /* A kTLS read into a pipe that cannot hold a whole record loses the rest of it (see the top of
     * this file): refuse the connection, never truncate its stream. */
    if (r1 > 0 && r2 > 0 && (flags & SP_GW_KTLS) && (r1 < SP_KTLS_MIN_PIPE || r2 < SP_KTLS_MIN_PIPE))
        r1 = -ENOBUFS;
    if (r1 < 0 || r2 < 0) {
        close_dir_pipes(&c->up);
        close_dir_pipes(&c->down);
        c->gw = c->sb = -1;
        give_back_slot(p, c);
        return r1 < 0 ? r1 : r2;
    }
    c->up.in_fd = gw_fd;
    c->up.out_fd = sb_fd;
    c->up.in_ktls = (flags & SP_GW_KTLS) != 0;
    c->down.in_fd = sb_fd;
    c->down.out_fd = gw_fd;
    c->down.out_ktls = (flags & SP_GW_KTLS) != 0;
    pthread_mutex_lock(&p->mu);
    p->st.added++;
    pthread_mutex_unlock(&p->mu);
    enqueue(p, c);
    return (int64_t)c->ev.id;
}

int sp_detach(sp_pump *p, uint64_t id, struct sp_detached *out)
{
    struct conn *c = NULL;
    struct worker *w = NULL;
    pthread_mutex_lock(&p->mu);
    struct conn *found = lookup(p, id);
    if (found) {
        int st = __atomic_load_n(&found->state, __ATOMIC_ACQUIRE);
        if (st == ST_PAUSED) {
            /* No thread has it: its descriptors and state are handed back as adopted. */
            struct sp_detached *d = &found->det;
            memset(d, 0, sizeof *d);
            d->gw_fd = found->gw;
            d->sb_fd = found->sb;
            d->up_pr = found->up.pr;
            d->up_pw = found->up.pw;
            d->down_pr = found->down.pr;
            d->down_pw = found->down.pw;
            d->up_pipe_bytes = found->up.pipe_bytes;
            d->down_pipe_bytes = found->down.pipe_bytes;
            d->flags = found->flags;
            d->evflags = found->evflags;
            d->close_timeout_ms = found->close_timeout_ms;
            d->close_left_ms = found->adopt_left_ms;
            d->dir_state = (found->up.in_eof ? SP_DS_UP_IN_EOF : 0) | (found->up.out_shut ? SP_DS_UP_OUT_SHUT : 0) |
                           (found->down.in_eof ? SP_DS_DOWN_IN_EOF : 0) |
                           (found->down.out_shut ? SP_DS_DOWN_OUT_SHUT : 0);
            d->bytes_up = found->up.bytes;
            d->bytes_down = found->down.bytes;
            *out = *d;
            p->st.finished++;
            p->st.bytes_up += d->bytes_up;
            p->st.bytes_down += d->bytes_down;
            __atomic_store_n(&found->state, ST_FREE, __ATOMIC_RELEASE);
            p->free_slots[p->nfree++] = found->slot;
            pthread_mutex_unlock(&p->mu);
            return 0;
        }
        if (st == ST_LIVE || st == ST_PENDING) {
            c = found;
            w = c->w;
            c->detach_state = DET_NONE;
            __atomic_store_n(&c->detach_req, 1, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&p->mu);
    if (!c)
        return -ENOENT;
    __atomic_store_n(&w->abort_pending, 1, __ATOMIC_RELEASE);
    wake(w->wakefd);
    int rc;
    pthread_mutex_lock(&p->mu);
    while (c->detach_state == DET_NONE)
        pthread_cond_wait(&p->detach_cv, &p->mu);
    if (c->detach_state == DET_DONE) {
        *out = c->det;
        p->st.finished++; /* gone from here as a finished one would be, its bytes with it */
        p->st.bytes_up += c->det.bytes_up;
        p->st.bytes_down += c->det.bytes_down;
        __atomic_store_n(&c->state, ST_FREE, __ATOMIC_RELEASE);
        p->free_slots[p->nfree++] = c->slot;
        rc = 0;
    } else {
        rc = -ENOENT; /* finished first: its event is queued, its slot freed when that is taken */
    }
    __atomic_store_n(&c->detach_req, 0, __ATOMIC_RELEASE);
    c->detach_state = DET_NONE;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

static int adopt_dir(struct dir *d, int in_fd, int out_fd, int pr, int pw, uint32_t pipe_bytes, int in_eof,
                     int out_shut)
{
    int got = fcntl(pw, F_GETPIPE_SZ);
    if (got <= 0 || check_nonblocking(pr) < 0 || check_nonblocking(pw) < 0 || pipe_bytes > (uint32_t)got)
        return -EINVAL;
    d->in_fd = in_fd;
    d->out_fd = out_fd;
    d->pr = pr;
    d->pw = pw;
    d->pipe_bytes = pipe_bytes;
    d->cap = (uint32_t)got;
    d->in_eof = (uint8_t)in_eof;
    d->out_shut = (uint8_t)out_shut;
    return 0;
}

int64_t sp_adopt(sp_pump *p, const struct sp_detached *d, int paused)
{
    int fds[6] = {d->gw_fd, d->sb_fd, d->up_pr, d->up_pw, d->down_pr, d->down_pw};
    for (int i = 0; i < 6; i++)
        for (int j = i + 1; j < 6; j++)
            if (fds[i] < 0 || fds[i] == fds[j])
                return -EINVAL;
    if ((d->flags & ~SP_GW_KTLS) || (d->dir_state & ~0xfu) || check_nonblocking(d->gw_fd) < 0 ||
        check_nonblocking(d->sb_fd) < 0)
        return -EINVAL;
    int ktls = (d->flags & SP_GW_KTLS) != 0;
    struct conn *c = take_slot(p);
    if (!c)
        return -ENOSPC;
    int r = adopt_dir(&c->up, d->gw_fd, d->sb_fd, d->up_pr, d->up_pw, d->up_pipe_bytes,
                      (d->dir_state & SP_DS_UP_IN_EOF) != 0, (d->dir_state & SP_DS_UP_OUT_SHUT) != 0);
    if (r == 0)
        r = adopt_dir(&c->down, d->sb_fd, d->gw_fd, d->down_pr, d->down_pw, d->down_pipe_bytes,
                      (d->dir_state & SP_DS_DOWN_IN_EOF) != 0, (d->dir_state & SP_DS_DOWN_OUT_SHUT) != 0);
    if (r == 0 && ktls && (c->up.cap < SP_KTLS_MIN_PIPE || c->down.cap < SP_KTLS_MIN_PIPE))
        r = -ENOBUFS;
    if (r < 0) {
        give_back_slot(p, c); /* the descriptors stay the caller's */
        return r;
    }
    c->up.in_ktls = c->down.out_ktls = (uint8_t)ktls;
    c->gw = d->gw_fd;
    c->sb = d->sb_fd;
    c->flags = d->flags;
    c->evflags = d->evflags;
    c->close_timeout_ms = d->close_timeout_ms;
    c->adopt_left_ms = d->close_left_ms;
    c->up.bytes = d->bytes_up;
    c->down.bytes = d->bytes_down;
    pthread_mutex_lock(&p->mu);
    p->st.added++;
    if (paused)
        __atomic_store_n(&c->state, ST_PAUSED, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&p->mu);
    if (!paused)
        enqueue(p, c);
    return (int64_t)c->ev.id;
}

int sp_resume(sp_pump *p, uint64_t id)
{
    pthread_mutex_lock(&p->mu);
    struct conn *c = lookup(p, id);
    int ok = c && __atomic_load_n(&c->state, __ATOMIC_ACQUIRE) == ST_PAUSED;
    if (ok)
        __atomic_store_n(&c->state, ST_PENDING, __ATOMIC_RELEASE); /* no other resume can take it now */
    pthread_mutex_unlock(&p->mu);
    if (!ok)
        return -ENOENT;
    enqueue(p, c);
    return 0;
}

static struct conn *lookup(sp_pump *p, uint64_t id)
{
    uint32_t slot = (uint32_t)(id & 0xffffffffu);
    if (slot >= (uint32_t)p->max_conns)
        return NULL;
    struct conn *c = &p->conns[slot];
    return c->gen == (uint32_t)(id >> 32) ? c : NULL;
}

int sp_counters(sp_pump *p, uint64_t id, uint64_t *up, uint64_t *down)
{
    int rc = -ENOENT;
    pthread_mutex_lock(&p->mu); /* the slot cannot be released or reused while we hold it */
    struct conn *c = lookup(p, id);
    if (c) {
        int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
        if (st == ST_LIVE || st == ST_PENDING || st == ST_PAUSED) {
            *up = __atomic_load_n(&c->up.bytes, __ATOMIC_RELAXED);
            *down = __atomic_load_n(&c->down.bytes, __ATOMIC_RELAXED);
            rc = 0;
        }
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int sp_take_moved(sp_pump *p, struct sp_moved *out, int max, uint32_t *cursor)
{
    int n = 0;
    uint32_t s = *cursor;
    pthread_mutex_lock(&p->mu); /* as in sp_counters: no slot is released or reused meanwhile */
    for (; s < (uint32_t)p->max_conns && n < max; s++) {
        struct conn *c = &p->conns[s];
        int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
        if (st != ST_LIVE && st != ST_PENDING && st != ST_PAUSED)
            continue;
        uint64_t up = __atomic_load_n(&c->up.bytes, __ATOMIC_RELAXED);
        uint64_t down = __atomic_load_n(&c->down.bytes, __ATOMIC_RELAXED);
        if (up == c->moved_up && down == c->moved_down)
            continue;
        c->moved_up = up;
        c->moved_down = down;
        out[n].id = ((uint64_t)c->gen << 32) | s;
        out[n].bytes_up = up;
        out[n].bytes_down = down;
        n++;
    }
    pthread_mutex_unlock(&p->mu);
    *cursor = s;
    return n;
}

int sp_take_events(sp_pump *p, struct sp_event *out, int max)
{
    uint64_t v;
    ssize_t r = read(p->evfd, &v, sizeof v); /* reset readiness before looking, so nothing is missed */
    (void)r;
    int n = 0;
    pthread_mutex_lock(&p->mu);
    while (n < max && p->evq_len > 0) {
        uint32_t slot = p->evq[p->evq_head];
        p->evq_head = (p->evq_head + 1) % p->max_conns;
        p->evq_len--;
        struct conn *c = &p->conns[slot];
        out[n++] = c->ev;
        __atomic_store_n(&c->state, ST_FREE, __ATOMIC_RELEASE);
        p->free_slots[p->nfree++] = slot;
    }
    int more = p->evq_len > 0;
    pthread_mutex_unlock(&p->mu);
    if (more)
        wake(p->evfd);
    return n;
}

int sp_abort(sp_pump *p, uint64_t id, int reset)
{
    int rc = -ENOENT;
    struct worker *w = NULL;
    pthread_mutex_lock(&p->mu);
    struct conn *c = lookup(p, id);
    if (c) {
        int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
        if (st == ST_LIVE || st == ST_PENDING) {
            __atomic_store_n(&c->abort_req, reset ? 2 : 1, __ATOMIC_RELEASE);
            w = c->w;
            rc = 0;
        }
    }
    pthread_mutex_unlock(&p->mu);
    if (w) {
        __atomic_store_n(&w->abort_pending, 1, __ATOMIC_RELEASE);
        wake(w->wakefd);
    }
    return rc;
}

void sp_get_stats(sp_pump *p, struct sp_stats *out)
{
    pthread_mutex_lock(&p->mu);
    *out = p->st;
    uint64_t live = 0;
    for (int i = 0; i < p->max_conns; i++) {
        struct conn *c = &p->conns[i];
        int st = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
        if (st == ST_LIVE || st == ST_PENDING || st == ST_PAUSED) {
            live++;
            out->bytes_up += __atomic_load_n(&c->up.bytes, __ATOMIC_RELAXED);
            out->bytes_down += __atomic_load_n(&c->down.bytes, __ATOMIC_RELAXED);
        }
    }
    pthread_mutex_unlock(&p->mu);
    out->active = live;
    out->splice_calls = __atomic_load_n(&p->splice_calls, __ATOMIC_RELAXED);
    out->control_records = __atomic_load_n(&p->control_records, __ATOMIC_RELAXED);
}
