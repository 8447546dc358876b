// kvshare_xdna needs one translation unit until its units land; it names the library.
namespace kvshare::xdna {
const char* library_name() { return "kvshare_xdna"; }
}  // namespace kvshare::xdna
