// kvshare_refmodel needs one translation unit until its units land; it names the library.
namespace kvshare::refmodel {
const char* library_name() { return "kvshare_refmodel"; }
}  // namespace kvshare::refmodel
