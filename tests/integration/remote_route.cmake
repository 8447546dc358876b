# remote_route: kvshare-serve --prefill-remote with kvshare-provider-server, the KV moved
# over UCX (tcp): on loopback, and as root across two network namespaces joined by a veth
# pair (skipped with a message when not root). Exit 77 = skipped.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME remote_route_loopback
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/remote_route.py ${CMAKE_BINARY_DIR}/bin
                   ${CMAKE_BINARY_DIR}/tests --loopback)
  add_test(NAME remote_route_netns
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/remote_route.py ${CMAKE_BINARY_DIR}/bin
                   ${CMAKE_BINARY_DIR}/tests --netns)
  set_tests_properties(remote_route_loopback remote_route_netns
                       PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77 LABELS remote RUN_SERIAL TRUE)
endif()
