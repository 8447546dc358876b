# cmake --install: the C API only (docs/layers.md) — libkvshare_c.so and kvshare.h (installed
# by capi/CMakeLists.txt), a CMake package (find_package(kvshare), the imported target
# kvshare::kvshare_c) and kvshare-c.pc, so llama-server or an NPU engine links kvshare
# without building inside this tree. The C++ libraries are linked into libkvshare_c and
# hidden by its version script; their headers are not an interface and are not installed.
include(CMakePackageConfigHelpers)

install(EXPORT kvshareTargets NAMESPACE kvshare:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshare)
configure_package_config_file(${PROJECT_SOURCE_DIR}/scripts/cmake/kvshareConfig.cmake.in
  ${CMAKE_BINARY_DIR}/kvshareConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshare)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/kvshareConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/kvshareConfig.cmake ${CMAKE_BINARY_DIR}/kvshareConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshare)
