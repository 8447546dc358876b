# cmake --install: public headers, the libraries, a CMake package (find_package(kvshare)
# with kvshare:: imported targets) and a pkg-config file, so llama-server or an NPU engine
# can link kvshare without building inside this tree.
include(CMakePackageConfigHelpers)

get_property(kvshare_libraries GLOBAL PROPERTY KVSHARE_LIBRARIES)
get_property(kvshare_header_dirs GLOBAL PROPERTY KVSHARE_HEADER_DIRS)

install(TARGETS ${kvshare_libraries}
  EXPORT kvshareTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(dir IN LISTS kvshare_header_dirs)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}/
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvshare/${dir}
    FILES_MATCHING PATTERN "*.h")
endforeach()
install(EXPORT kvshareTargets NAMESPACE kvshare:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshare)

configure_package_config_file(${PROJECT_SOURCE_DIR}/scripts/cmake/kvshareConfig.cmake.in
  ${CMAKE_BINARY_DIR}/kvshareConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshare)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/kvshareConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/kvshareConfig.cmake ${CMAKE_BINARY_DIR}/kvshareConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvshare)

# Static linking wants dependents first: the reverse of the order the libraries were added.
set(kvshare_pc_order ${kvshare_libraries})
list(REVERSE kvshare_pc_order)
list(JOIN kvshare_pc_order " -l" kvshare_pc_libs)
configure_file(${PROJECT_SOURCE_DIR}/scripts/cmake/kvshare.pc.in ${CMAKE_BINARY_DIR}/kvshare.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/kvshare.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
