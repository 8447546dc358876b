#include "kvshare/sys.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>

namespace kvshare::sys {
namespace {

int real_open(const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); }
int real_fcntl_int(int fd, int cmd, int arg) { return ::fcntl(fd, cmd, arg); }
int real_ioctl_ptr(int fd, unsigned long request, void* arg) { return ::ioctl(fd, request, arg); }
int real_memfd_create(const char* name, unsigned int flags) { return ::memfd_create(name, flags); }

const Ops kRealOps{
    real_open,      ::close,           ::read,    ::write,  ::pread,  ::pwrite,  ::fsync, ::ftruncate, real_fcntl_int,
    real_ioctl_ptr, real_memfd_create, ::mmap,    ::munmap, ::socket, ::connect, ::bind,  ::listen,    ::setsockopt,
    ::accept4,      ::sendmsg,         ::recvmsg, ::poll,   ::rename, ::unlink,  ::kill,  ::waitpid,   ::madvise,
    ::flock,
};

std::atomic<const Ops*> current{&kRealOps};

}  // namespace

const Ops& ops() { return *current.load(std::memory_order_acquire); }
const Ops& real_ops() { return kRealOps; }

ScopedOverride::ScopedOverride(const Ops& replacement) : previous_(current.load()), table_(replacement) {
  current.store(&table_, std::memory_order_release);
}

ScopedOverride::~ScopedOverride() { current.store(previous_, std::memory_order_release); }

}  // namespace kvshare::sys
