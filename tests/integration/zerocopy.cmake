# The zero-copy core's helpers (issue 4). Included by tests/integration/CMakeLists.txt.

# The child provider the two-process share test starts through the broker: it imports the
# inherited fds, checks that nothing else was inherited, and writes a pattern into every
# cache_k_l<L>/cache_v_l<L>.
add_executable(kvshare-test-child-provider ${PROJECT_SOURCE_DIR}/tests/kvshare/share/child_provider_main.cc)
target_link_libraries(kvshare-test-child-provider PRIVATE kvshare kvshare_layout)
kvshare_target_defaults(kvshare-test-child-provider)
if(TARGET kvshare_tests)
  add_dependencies(kvshare_tests kvshare-test-child-provider)
endif()

# zerocopy_dev_tests: only this part's suites, for a quick edit-build-run loop without the
# other parts' tools (not built by default; the same tests run in kvshare_tests).
file(GLOB zerocopy_dev_test_sources CONFIGURE_DEPENDS
  ${PROJECT_SOURCE_DIR}/tests/kvshare/region/*_test.cc
  ${PROJECT_SOURCE_DIR}/tests/kvshare/handshake/*_test.cc
  ${PROJECT_SOURCE_DIR}/tests/kvshare/share/*_test.cc
  ${PROJECT_SOURCE_DIR}/tests/kvshare/env_test.cc)
add_executable(zerocopy_dev_tests EXCLUDE_FROM_ALL ${zerocopy_dev_test_sources})
target_link_libraries(zerocopy_dev_tests PRIVATE kvshare kvshare_layout kvshare_test_support
                      GTest::gtest_main nlohmann_json::nlohmann_json)
kvshare_target_defaults(zerocopy_dev_tests)
set_target_properties(zerocopy_dev_tests PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
add_dependencies(zerocopy_dev_tests kvshare-test-child-provider)
