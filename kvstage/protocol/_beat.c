/* Pings on kvstage's control connections from a native thread, and the sends
 * they share the sockets with (kvstage/protocol/beat.py loads this with ctypes;
 * it has no Python API).
 *
 * Why native: an endpoint's loop is a Python thread in an engine's process.
 * While the engine's own threads hold the GIL (a long forward pass, a busy
 * scheduler), the loop cannot run, and pings it sent itself would stop: its
 * peers would take a busy engine for a dead one. This thread needs no GIL, so
 * a live process keeps pinging; only a stopped process (SIGSTOP), a hung host
 * or a cut link goes quiet. Each ping says how long ago the endpoint's loop
 * last turned ("loop_s"), so a peer can tell a busy engine from a broken one.
 *
 * A ping and a message from Python must never interleave on one socket: both
 * go through kvstage_beat_send, under a lock per socket (striped by
 * descriptor). The pinger only tries the lock: a socket with a send in
 * progress is carrying bytes already. */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define STRIPES 1024
#define MAX_WATCHED 4096

static pthread_mutex_t stripes[STRIPES];
static pthread_once_t once = PTHREAD_ONCE_INIT;

struct watched {
    int fd;
    const volatile double *turn; /* CLOCK_MONOTONIC seconds of the endpoint loop's last turn */
};

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static struct watched table[MAX_WATCHED];
static int nwatched = 0;
static pthread_t thread;
static int running = 0;
static double interval_s = 1.0;

static void init_stripes(void)
{
    for (int i = 0; i < STRIPES; i++)
        pthread_mutex_init(&stripes[i], NULL);
}

static pthread_mutex_t *stripe(int fd)
{
    pthread_once(&once, init_stripes);
    return &stripes[(unsigned)fd % STRIPES];
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Send all of buf, blocking, with the stripe lock held by the caller. 0 or -errno. */
static int send_all(int fd, const char *buf, size_t len)
{
    while (len) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) { /* a non-blocking socket: wait until writable */
                struct timespec pause = {0, 100000};
                nanosleep(&pause, NULL);
                continue;
            }
            return -errno;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* A whole frame from Python (called without the GIL): never interleaved with a ping. */
int kvstage_beat_send(int fd, const char *buf, size_t len)
{
    pthread_mutex_t *m = stripe(fd);
    pthread_mutex_lock(m);
    int rc = send_all(fd, buf, len);
    pthread_mutex_unlock(m);
    return rc;
}

static void ping(const struct watched *w, double now)
{
    char body[96], frame[100];
    double loop_s = now - *w->turn;
    if (loop_s < 0)
        loop_s = 0;
    int n = snprintf(body, sizeof body, "{\"type\":\"ping\",\"loop_s\":%.3f}", loop_s);
    if (n <= 0 || n >= (int)sizeof body)
        return;
    uint32_t be = htonl((uint32_t)n);
    memcpy(frame, &be, 4);
    memcpy(frame + 4, body, (size_t)n);
    pthread_mutex_t *m = stripe(w->fd);
    if (pthread_mutex_trylock(m) != 0)
        return; /* a send is under way: the peer hears from this socket anyway */
    ssize_t sent = send(w->fd, frame, (size_t)n + 4, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0 && sent < n + 4) /* begun: the frame is finished, or the stream would break */
        send_all(w->fd, frame + sent, (size_t)(n + 4 - sent));
    pthread_mutex_unlock(m);
}

static void *run(void *arg)
{
    (void)arg;
    for (;;) {
        struct timespec pause;
        pause.tv_sec = (time_t)interval_s;
        pause.tv_nsec = (long)((interval_s - (double)pause.tv_sec) * 1e9);
        nanosleep(&pause, NULL);
        double now = now_s();
        pthread_mutex_lock(&table_lock);
        for (int i = 0; i < nwatched; i++)
            ping(&table[i], now);
        pthread_mutex_unlock(&table_lock);
    }
    return NULL;
}

/* Start the pinger (once per process): a ping every interval seconds on each watched socket. */
int kvstage_beat_start(double interval)
{
    pthread_mutex_lock(&table_lock);
    int rc = 0;
    if (!running) {
        interval_s = interval;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&thread, &attr, run, NULL);
        pthread_attr_destroy(&attr);
        running = rc == 0;
    }
    pthread_mutex_unlock(&table_lock);
    return rc;
}

/* Ping fd from now on, saying how long ago *turn (the endpoint loop's clock) last moved. 0, or -1 when full. */
int kvstage_beat_watch(int fd, const volatile double *turn)
{
    pthread_mutex_lock(&table_lock);
    int rc = -1;
    for (int i = 0; i < nwatched; i++)
        if (table[i].fd == fd) {
            table[i].turn = turn;
            rc = 0;
        }
    if (rc && nwatched < MAX_WATCHED) {
        table[nwatched].fd = fd;
        table[nwatched].turn = turn;
        nwatched++;
        rc = 0;
    }
    pthread_mutex_unlock(&table_lock);
    return rc;
}

/* Stop pinging fd; once this returns the pinger no longer touches it (the caller may close it). */
void kvstage_beat_forget(int fd)
{
    pthread_mutex_lock(&table_lock);
    for (int i = 0; i < nwatched; i++)
        if (table[i].fd == fd) {
            table[i] = table[--nwatched];
            break;
        }
    pthread_mutex_unlock(&table_lock);
}

int kvstage_beat_count(void)
{
    pthread_mutex_lock(&table_lock);
    int n = nwatched;
    pthread_mutex_unlock(&table_lock);
    return n;
}
